// The per-gradient path of phase 1 in C++ (issue 16): one autograd post hook per parameter, on its
// AccumulateGrad node (as DDP's reducer registers its own), which copies the gradient into its
// bucket slot (or points .grad at its slot: stage 1's gradient views), counts the bucket's missing
// gradients and launches every complete bucket in order, without a Python frame. Python decides
// the rest (zerofast/grads.py): the first gradient of a backward, no_sync, fp16's scaling check,
// the overlapped gather's check, clip-before-step, check_collectives and every error go to its
// on_grad callback (with the GIL), which calls accept() for the common work once it has decided.
// See [Note: the gradient path] in zerofast/grads.py.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/node.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "buckets.h"

namespace zerofast {

class GradPath {
 public:
  // params: the managed parameters; bucket/offset: each one's slot; bucket_params: parameters per
  // bucket; views: stage 1's slot views, shaped as the parameters (empty: copy into the bucket);
  // drop_grad: stages 2 and 3 drop .grad once it is in the bucket; overlap: launch complete
  // buckets during backward; on_grad(index): Python's path; on_error(index, what): formats and
  // raises a failure of the fast path as Python would (zerofast.comm.CollectiveError).
  GradPath(BucketComm& comm, std::vector<at::Tensor> params, std::vector<int64_t> bucket,
           std::vector<int64_t> offset, std::vector<int64_t> bucket_params, std::vector<at::Tensor> views,
           bool drop_grad, bool overlap, pybind11::object on_grad, pybind11::object on_error);
  ~GradPath();
  GradPath(const GradPath&) = delete;
  GradPath& operator=(const GradPath&) = delete;

  // The hook's entry (autograd's thread, no GIL).
  void on_hook(int64_t index);
  // The common work for one gradient, once Python has decided (or from the hook): into the slot,
  // .grad dropped (stages 2 and 3), the bucket counted, complete buckets launched (with overlap).
  void accept(int64_t index);
  // Launch every complete bucket whose predecessors have started (buckets strictly in order).
  void launch_ready();
  // Mark every slot of buckets from next_launch on as filled (flush: Python has zeroed or copied
  // what was missing) and launch them.
  void fill_rest();
  // A new micro-batch (got_grad and missing reset) or a new step (used too).
  void begin_micro_batch();
  void begin_step();
  void remove_hooks();

  // State Python reads and sets (see zerofast/grads.py).
  bool python_decides = true;   // every gradient through Python's on_grad (no_sync, fp16, ...)
  bool in_backward = false;     // a backward has delivered its first gradient (Python queued its end)
  bool accumulate = false;      // reduces add into the shard (later micro-batches under no_sync)
  std::vector<uint8_t> used;    // got a gradient on this rank in this step
  std::vector<uint8_t> got_grad;  // in its bucket in this micro-batch
  std::vector<int64_t> missing;   // per bucket: gradients still to come in this micro-batch
  int64_t next_launch = 0;
  int64_t fast_calls = 0;       // gradients the hook handled without Python (for tests)

 private:
  BucketComm& comm_;
  std::vector<at::Tensor> params_;
  std::vector<int64_t> bucket_;
  std::vector<int64_t> offset_;
  std::vector<int64_t> bucket_params_;
  std::vector<at::Tensor> views_;
  bool drop_grad_;
  bool overlap_;
  pybind11::object on_grad_;
  pybind11::object on_error_;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
};

}  // namespace zerofast
