// Every difference between the torch releases zerofast builds against (2.11 to 2.14), each named by
// the release that brought it; nothing else in csrc/ tests a torch version. Python's differences
// are in zerofast/compat.py, which also holds the supported range (setup.py refuses a torch outside
// it before anything is compiled, so an unsupported torch is a sentence, never a compile error).
#pragma once

#include <torch/csrc/autograd/function.h>  // Node: declared here up to 2.12; from 2.13 in node.h, which this includes
#include <torch/csrc/autograd/variable.h>
#include <torch/headeronly/version.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace zerofast::compat {

// A parameter's gradient accumulator, as torch::autograd::impl::grad_accumulator returns it:
// std::shared_ptr<Node> up to torch 2.12, c10::intrusive_ptr<Node> from 2.13.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 12
using NodePtr = std::shared_ptr<torch::autograd::Node>;
#else
using NodePtr = c10::intrusive_ptr<torch::autograd::Node>;
#endif
static_assert(std::is_same_v<NodePtr, decltype(torch::autograd::impl::grad_accumulator(
                                          std::declval<const torch::autograd::Variable&>()))>,
              "zerofast/csrc/torch_compat.h: this torch's grad_accumulator returns another pointer type than "
              "NodePtr says for its release; add the release there");

}  // namespace zerofast::compat
