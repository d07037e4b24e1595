// See grad_path.h; [Note: the gradient path] is at on_hook().
#include "grad_path.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>

namespace zerofast {

namespace {

// A post hook on a parameter's AccumulateGrad node: runs once the gradient is accumulated into
// .grad, as DDP's reducer hooks do. Several post hooks may live on one node, so user hooks and
// ours never replace each other.
class AccumulatedHook : public torch::autograd::FunctionPostHook {
 public:
  AccumulatedHook(GradPath* path, int64_t index) : path_(path), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    path_->on_hook(index_);
    return outputs;
  }

 private:
  GradPath* path_;
  int64_t index_;
};

std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

}  // namespace

GradPath::GradPath(BucketComm& comm, GradPathOptions options, GradPathCallbacks callbacks)
    : comm_(comm),
      options_(std::move(options)),
      callbacks_(std::move(callbacks)),
      params_of_bucket_(options_.bucket_params.size()),
      used_(options_.params.size(), 0),
      slot_(options_.params.size(), Slot::kEmpty),
      missing_(options_.bucket_params) {
  check_and_index();
  add_hooks();
}

void GradPath::check_and_index() {
  const auto& o = options_;
  const size_t n = o.params.size();
  TORCH_CHECK(
      o.names.size() == n && o.bucket.size() == n && o.offset.size() == n && (o.views.empty() || o.views.size() == n),
      "GradPath: names (", o.names.size(), "), bucket (", o.bucket.size(), "), offset (", o.offset.size(),
      ") and views (", o.views.size(), ") need one entry per parameter (", n, ")");
  TORCH_CHECK(static_cast<bool>(callbacks_.on_grad),
              "GradPath: on_grad is needed (the path of the gradients the hook does not take)");
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(o.params[i].requires_grad(), "GradPath: parameter ", i, " does not require grad");
    TORCH_CHECK(o.bucket[i] >= 0 && o.bucket[i] < static_cast<int64_t>(o.bucket_params.size()), "GradPath: parameter ",
                i, " has bucket ", o.bucket[i], " of ", o.bucket_params.size());
    params_of_bucket_[o.bucket[i]].push_back(static_cast<int64_t>(i));
  }
  for (size_t b = 0; b < o.bucket_params.size(); ++b) {
    TORCH_CHECK(static_cast<int64_t>(params_of_bucket_[b].size()) == o.bucket_params[b], "GradPath: bucket ", b,
                " holds ", params_of_bucket_[b].size(), " parameters; bucket_params says ", o.bucket_params[b]);
  }
}

void GradPath::add_hooks() {
  for (size_t i = 0; i < options_.params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(options_.params[i]);
    TORCH_CHECK(acc, "GradPath: parameter ", i, " has no gradient accumulator (is it a leaf?)");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<AccumulatedHook>(this, static_cast<int64_t>(i))));
    accumulators_.push_back(std::move(acc));
  }
}

GradPath::~GradPath() { remove_hooks(); }

void GradPath::remove_hooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  accumulators_.clear();
  hook_keys_.clear();
}

// [Note: the gradient path]
// Each gradient's work in phase 1 is GradPath's: one autograd post hook per parameter, on its
// AccumulateGrad node (where DDP's reducer hooks too; several post hooks live on one node, so a
// user's hooks and ours never replace each other), checks the gradient against its parameter,
// puts it into its slot (stage 1: points .grad at it; under no_sync with local accumulation:
// leaves it in .grad, marked local, for flush()), drops .grad (stages 2 and 3), counts the bucket
// and launches every complete bucket in order, with no Python frame. GradPath holds every
// gradient's state in the step (which parameters got a gradient, each slot's state, each bucket's
// missing count, the next bucket to launch); Python mirrors none of it.
// Python's GradReducer (zerofast/optim/grads.py) holds the step's phase (StepPhase) and sets how
// gradients are taken from it, in one place (GradReducer._enter: python_decides, keep_local,
// accumulate). Python decides, through on_grad (called with the GIL), the first gradient of each
// backward (it queues the backward's end and enters the phase), every gradient after
// clip_grad_norm_() (an error) and every gradient where a check of its own runs per gradient: fp16
// (each checks its backward was scaled), the overlapped gather (each checks its bucket was waited
// for), check_collectives (each launch is described first, through before_launch). It then calls
// take(), the same work the hook does.
// Errors cross as their kind (errors.h): a gradient take() cannot accept is a GradientError naming
// the parameter, handed to on_gradient_error, which raises it as zerofast._C.GradientError (the
// binding, bindings.cpp); a CommError (a reduce that could not be launched or waited for) goes to
// on_comm_error (Python's on_error), which raises the CollectiveError Python's path raises for it,
// naming the step and the bucket. Anything else propagates as itself.
// Measured (benchmarks/bench_grad_path.py): see docs/benchmarks.md, "Many small tensors".
void GradPath::on_hook(int64_t index) {
  if (python_decides || !in_backward) {
    callbacks_.on_grad(index);
    return;
  }
  try {
    take(index);
    ++fast_calls;
  } catch (const GradientError& e) {
    if (callbacks_.on_gradient_error) callbacks_.on_gradient_error(e);  // raises zerofast._C.GradientError
    throw;
  } catch (const CommError& e) {
    if (callbacks_.on_comm_error) callbacks_.on_comm_error(index, e);  // raises zerofast.comm.CollectiveError
    throw;                                                             // the reducer is gone: the error as it is
  }
}

void GradPath::check_grad(int64_t index, const at::Tensor& grad) const {
  const at::Tensor& param = options_.params[index];
  const std::string& name = options_.names[index];
  auto fail = [&](const std::string& problem) { throw GradientError(options_.who + ": " + name + " got " + problem); };
  if (!grad.defined()) {
    fail("no gradient: its .grad is None after backward accumulated into it (did a hook set it to None?)");
  }
  if (grad.layout() != at::kStrided) {
    std::ostringstream s;
    s << "a sparse gradient (layout " << grad.layout() << "); " << options_.who
      << " reduces dense gradients only: build "
      << "the module with sparse=False (nn.Embedding(..., sparse=False), nn.EmbeddingBag(..., sparse=False))";
    fail(s.str());
  }
  if (grad.scalar_type() != param.scalar_type()) {
    fail("a gradient of dtype " + dtype_name(grad.scalar_type()) + " for a parameter of dtype " +
         dtype_name(param.scalar_type()) + " (was .grad replaced, or its .data?)");
  }
  if (grad.device() != param.device()) {
    fail("a gradient on " + grad.device().str() + " for a parameter on " + param.device().str() +
         " (was .grad replaced, or its .data?)");
  }
  if (grad.sizes() != param.sizes()) {
    std::ostringstream s;
    s << "a gradient of shape " << grad.sizes() << " for a parameter of shape " << param.sizes()
      << " (was .grad replaced, or its .data?)";
    fail(s.str());
  }
}

void GradPath::point_at_view(int64_t index, at::Tensor& grad) {
  // Stage 1: .grad is the slot ([Note: grads as bucket views] in buckets.cpp). Autograd accumulated
  // into it in place, unless .grad was None (autograd then hands over a fresh tensor) or user code
  // replaced it: then its values are copied into the slot once, and the slot becomes .grad.
  const at::Tensor& view = options_.views[index];
  if (grad.data_ptr() != view.data_ptr()) {
    view.copy_(grad);
    grad = view;
  }
}

void GradPath::fill(int64_t index, at::Tensor& grad) {
  if (!options_.views.empty()) {
    point_at_view(index, grad);
  } else {
    comm_.add_grad(options_.bucket[index], options_.offset[index], grad);
  }
  slot_[index] = Slot::kFilled;
  if (options_.drop_grad) grad.reset();
}

void GradPath::take(int64_t index) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(options_.params.size()), "GradPath.take: index ", index,
              " out of range");
  at::Tensor& grad = options_.params[index].mutable_grad();
  check_grad(index, grad);
  used_[index] = 1;
  if (keep_local) {  // .grad accumulates across the micro-batches; flush() hands it over
    if (!options_.views.empty()) point_at_view(index, grad);
    slot_[index] = Slot::kLocal;
    return;
  }
  if (slot_[index] == Slot::kFilled) {
    throw GradientError(options_.who + ": " + options_.names[index] +
                        " got a second gradient before step(); call opt.step() after each backward, or run "
                        "the earlier backwards of an accumulated step inside `with opt.no_sync():`");
  }
  fill(index, grad);
  --missing_[options_.bucket[index]];
  if (options_.overlap) launch_ready();
}

void GradPath::launch_ready() {
  const int64_t n = static_cast<int64_t>(missing_.size());
  while (next_launch_ < n && missing_[next_launch_] == 0) {
    if (callbacks_.before_launch) callbacks_.before_launch(next_launch_);
    RECORD_FUNCTION("zerofast::reduce", std::vector<c10::IValue>());
    comm_.reduce(next_launch_, accumulate);
    ++next_launch_;
  }
}

void GradPath::flush() {
  const int64_t n = static_cast<int64_t>(missing_.size());
  for (int64_t b = next_launch_; b < n; ++b) {
    for (int64_t i : params_of_bucket_[b]) {
      if (slot_[i] == Slot::kFilled) continue;
      at::Tensor& grad = options_.params[i].mutable_grad();
      if (slot_[i] == Slot::kLocal && grad.defined()) {
        check_grad(i, grad);  // user code may have replaced .grad since backward
        fill(i, grad);
      } else {  // no gradient here: it counts as zero ([Note: unused parameters] in grads.py)
        comm_.zero_slot(b, options_.offset[i], options_.params[i].numel());
        slot_[i] = Slot::kFilled;
      }
    }
    missing_[b] = 0;
  }
  launch_ready();
}

void GradPath::begin_micro_batch() {
  for (auto& s : slot_) {
    if (s == Slot::kFilled) s = Slot::kEmpty;
  }
  missing_ = options_.bucket_params;
  next_launch_ = 0;
}

void GradPath::begin_step() {
  std::fill(slot_.begin(), slot_.end(), Slot::kEmpty);
  missing_ = options_.bucket_params;
  next_launch_ = 0;
  std::fill(used_.begin(), used_.end(), 0);
  accumulate = false;
  in_backward = false;
}

}  // namespace zerofast
