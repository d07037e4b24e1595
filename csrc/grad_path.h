// Phase 1's per-gradient path, and the one owner of every gradient's state in a step: one autograd
// post hook per parameter, on its AccumulateGrad node (as DDP's reducer registers its own), checks
// the gradient against its parameter, puts it into its bucket slot (or points .grad at its slot:
// stage 1's gradient views; or, under no_sync with local accumulation, leaves it in .grad),
// counts the bucket's missing gradients and launches every complete bucket in order, without a
// Python frame. Python (zerofast/optim/grads.py, GradReducer) keeps the step's phase and sets how
// gradients are taken from it (python_decides, keep_local, accumulate); the gradients that need
// Python go to its on_grad callback, which calls take() once it has decided. The callbacks are
// plain std::functions: the core knows no Python (bindings.cpp wraps Python's callables, taking the GIL
// around each call). See [Note: the gradient path] in grad_path.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "buckets.h"
#include "errors.h"
#include "torch_compat.h"

namespace zerofast {

// The managed parameters and where each one's gradient goes.
struct GradPathOptions {
  std::vector<at::Tensor> params;      // the managed parameters (leaves that require grad)
  std::vector<std::string> names;      // their names, for errors
  std::vector<int64_t> bucket;         // each parameter's bucket
  std::vector<int64_t> offset;         // and its slot's offset there
  std::vector<int64_t> bucket_params;  // parameters per bucket
  // Stage 1's slot views, shaped as the parameters ([Note: grads as bucket views] in buckets.cpp);
  // empty: gradients are copied into the bucket.
  std::vector<at::Tensor> views;
  bool drop_grad = false;        // stages 2 and 3: drop .grad once it is in the bucket
  bool overlap = true;           // launch complete buckets during backward
  std::string who = "ZeroAdam";  // the optimizer, as its errors name it (ZeroAdam, ZeroMuon)
};

// Where the hook hands over what it does not do itself. Each is called on the thread the hook runs
// on (autograd's); bindings.cpp's Python callables take the GIL themselves.
struct GradPathCallbacks {
  // The path for one gradient while python_decides or before a backward's first gradient is in
  // (Python: GradReducer._on_grad, which calls take() once it has decided). Required.
  std::function<void(int64_t index)> on_grad;
  // A CommError in the hook (a reduce that could not be launched or waited for): raises the error
  // the caller reports for it (Python: CollectiveError, naming the step and the bucket). Empty, or
  // returning: the CommError propagates as itself.
  std::function<void(int64_t index, const CommError& error)> on_comm_error;
  // A GradientError in the hook: autograd rethrows the hook's exceptions in backward()'s caller,
  // whose front end knows its own error types only, so this raises the error as that front end's
  // (Python: zerofast._C.GradientError). Empty, or returning: it propagates as itself.
  std::function<void(const GradientError& error)> on_gradient_error;
  // Called before each reduce is launched, or empty (check_collectives: every rank describes the
  // collective first).
  std::function<void(int64_t bucket)> before_launch;
};

class GradPath {
 public:
  // comm: the reduce/gather core the gradients go into; it outlives the path.
  GradPath(BucketComm& comm, GradPathOptions options, GradPathCallbacks callbacks);
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

  void check_and_index();  // the options' checks, and each bucket's parameters listed
  void add_hooks();

  BucketComm& comm_;
  const GradPathOptions options_;
  const GradPathCallbacks callbacks_;
  std::vector<std::vector<int64_t>> params_of_bucket_;
  std::vector<compat::NodePtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  std::vector<uint8_t> used_;  // got a gradient on this rank in this step
  std::vector<Slot> slot_;
  std::vector<int64_t> missing_;  // per bucket: gradients still to come in this micro-batch
  int64_t next_launch_ = 0;
};

}  // namespace zerofast
