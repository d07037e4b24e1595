// Phase 1's per-gradient path, and the one owner of every gradient's state in a step: one autograd
// post hook per parameter, on its AccumulateGrad node (as DDP's reducer registers its own), checks
// the gradient against its parameter, puts it into its bucket slot (or points .grad at its slot:
// stage 1's gradient views; or, under no_sync with local accumulation, leaves it in .grad),
// counts the bucket's missing gradients and launches every complete bucket in order, without a
// Python frame. Python (zerofast/optim/grads.py, GradReducer) keeps the step's phase and sets how
// gradients are taken from it (python_decides, keep_local, accumulate); the gradients that need
// Python go to its on_grad callback (with the GIL), which calls take() once it has decided. See
// [Note: the gradient path] in grad_path.cpp.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/node.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "buckets.h"
#include "errors.h"

namespace zerofast {

class GradPath {
 public:
  // params, names: the managed parameters and their names (for errors); bucket/offset: each one's
  // slot; bucket_params: parameters per bucket; views: stage 1's slot views, shaped as the
  // parameters (empty: copy into the bucket); drop_grad: stages 2 and 3 drop .grad once it is in
  // the bucket; overlap: launch complete buckets during backward; on_grad(index): Python's path;
  // on_error(index, message): raises a CommError of the hook's as zerofast.comm.CollectiveError;
  // before_launch(bucket): called (with the GIL) before each reduce is launched, or None
  // (check_collectives: every rank describes the collective first).
  GradPath(BucketComm& comm, std::vector<at::Tensor> params, std::vector<std::string> names,
           std::vector<int64_t> bucket, std::vector<int64_t> offset, std::vector<int64_t> bucket_params,
           std::vector<at::Tensor> views, bool drop_grad, bool overlap, pybind11::object on_grad,
           pybind11::object on_error, pybind11::object before_launch);
  ~GradPath();
  GradPath(const GradPath&) = delete;
  GradPath& operator=(const GradPath&) = delete;

  // The hook's entry (autograd's thread, no GIL).
  void on_hook(int64_t index);
  // One gradient's work, as the current mode says (from the hook, or from Python once it has
  // decided): checked (GradientError), marked used, then kept in .grad (keep_local) or put into
  // its slot, .grad dropped (stages 2 and 3), the bucket counted and complete buckets launched
  // (with overlap). A second gradient in one micro-batch is a GradientError.
  void take(int64_t index);
  // Launch every complete bucket whose predecessors have started (buckets strictly in order).
  void launch_ready();
  // Phase 2's start: fill every slot of the buckets not launched yet (a locally accumulated
  // gradient, or zeros for a parameter without gradient here: [Note: unused parameters]) and launch
  // them.
  void flush();
  // A new micro-batch (slots filled in it count as empty again; locally accumulated ones stay) or
  // a new step (every slot empty, nothing used, no backward running).
  void begin_micro_batch();
  void begin_step();
  void remove_hooks();
  // Which parameters got a gradient on this rank in this step (the step's agreement sends it).
  std::vector<bool> used() const { return std::vector<bool>(used_.begin(), used_.end()); }
  int64_t next_launch() const { return next_launch_; }

  // How gradients are taken now, set by GradReducer from its StepPhase in one place (_enter).
  bool python_decides = true;  // every gradient through Python's on_grad (fp16, PREPARED, ...)
  bool keep_local = false;     // no_sync with local accumulation: .grad accumulates, flush() hands it over
  bool accumulate = false;     // reduces add into the shard (later micro-batches under no_sync)
  // A backward has delivered its first gradient (Python's on_grad queued its end, and clears it).
  bool in_backward = false;
  int64_t fast_calls = 0;  // gradients the hook handled without Python (for tests)

 private:
  enum class Slot : uint8_t {
    kEmpty,   // no gradient of this micro-batch in the bucket
    kLocal,   // accumulated in .grad under no_sync, not in the bucket yet (flush() puts it there)
    kFilled,  // in the bucket (or zeroed there by flush())
  };
  void check_grad(int64_t index, const at::Tensor& grad) const;
  void point_at_view(int64_t index, at::Tensor& grad);
  void fill(int64_t index, at::Tensor& grad);  // into the slot, .grad dropped in stages 2 and 3

  BucketComm& comm_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<int64_t> bucket_;
  std::vector<int64_t> offset_;
  std::vector<int64_t> bucket_params_;
  std::vector<std::vector<int64_t>> params_of_bucket_;
  std::vector<at::Tensor> views_;
  bool drop_grad_;
  bool overlap_;
  pybind11::object on_grad_;
  pybind11::object on_error_;
  pybind11::object before_launch_;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  std::vector<uint8_t> used_;  // got a gradient on this rank in this step
  std::vector<Slot> slot_;
  std::vector<int64_t> missing_;  // per bucket: gradients still to come in this micro-batch
  int64_t next_launch_ = 0;
};

// The Python class GradientError is bound to (ops.cpp sets it at import), for the hook, which has
// no pybind11 function around it to translate the exception.
extern PyObject* gradient_error_type;

}  // namespace zerofast
