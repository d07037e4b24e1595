// See grad_path.h; [Note: the gradient path] is at on_hook().
#include "grad_path.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>

namespace py = pybind11;

namespace zerofast {

PyObject* gradient_error_type = nullptr;

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

GradPath::GradPath(BucketComm& comm, std::vector<at::Tensor> params, std::vector<std::string> names,
                   std::vector<int64_t> bucket, std::vector<int64_t> offset, std::vector<int64_t> bucket_params,
                   std::vector<at::Tensor> views, bool drop_grad, bool overlap, py::object on_grad, py::object on_error,
                   py::object before_launch)
    : comm_(comm),
      params_(std::move(params)),
      names_(std::move(names)),
      bucket_(std::move(bucket)),
      offset_(std::move(offset)),
      bucket_params_(std::move(bucket_params)),
      params_of_bucket_(bucket_params_.size()),
      views_(std::move(views)),
      drop_grad_(drop_grad),
      overlap_(overlap),
      on_grad_(std::move(on_grad)),
      on_error_(std::move(on_error)),
      before_launch_(std::move(before_launch)),
      used_(params_.size(), 0),
      slot_(params_.size(), Slot::kEmpty),
      missing_(bucket_params_) {
  const size_t n = params_.size();
  TORCH_CHECK(
      names_.size() == n && bucket_.size() == n && offset_.size() == n && (views_.empty() || views_.size() == n),
      "GradPath: names (", names_.size(), "), bucket (", bucket_.size(), "), offset (", offset_.size(), ") and views (",
      views_.size(), ") need one entry per parameter (", n, ")");
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(params_[i].requires_grad(), "GradPath: parameter ", i, " does not require grad");
    TORCH_CHECK(bucket_[i] >= 0 && bucket_[i] < static_cast<int64_t>(bucket_params_.size()), "GradPath: parameter ", i,
                " has bucket ", bucket_[i], " of ", bucket_params_.size());
    params_of_bucket_[bucket_[i]].push_back(static_cast<int64_t>(i));
  }
  for (size_t b = 0; b < bucket_params_.size(); ++b) {
    TORCH_CHECK(static_cast<int64_t>(params_of_bucket_[b].size()) == bucket_params_[b], "GradPath: bucket ", b,
                " holds ", params_of_bucket_[b].size(), " parameters; bucket_params says ", bucket_params_[b]);
  }
  for (size_t i = 0; i < n; ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
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
// the parameter, raised here as zerofast._C.GradientError; a CommError (a reduce that could not be
// launched or waited for) goes to Python's on_error, which raises the CollectiveError Python's path
// raises for it, naming the step and the bucket. Anything else propagates as itself.
// Measured (benchmarks/bench_grad_path.py): see docs/benchmarks.md, "Many small tensors".
void GradPath::on_hook(int64_t index) {
  if (python_decides || !in_backward) {
    py::gil_scoped_acquire gil;
    on_grad_(index);
    return;
  }
  try {
    take(index);
    ++fast_calls;
  } catch (const GradientError& e) {
    py::gil_scoped_acquire gil;
    py::set_error(gradient_error_type != nullptr ? gradient_error_type : PyExc_RuntimeError, e.what());
    throw py::error_already_set();
  } catch (const CommError& e) {
    py::gil_scoped_acquire gil;
    on_error_(index, std::string(e.what()));  // raises zerofast.comm.CollectiveError
    throw;                                    // the reducer is gone: the error as it is
  }
}

void GradPath::check_grad(int64_t index, const at::Tensor& grad) const {
  const at::Tensor& param = params_[index];
  const std::string& name = names_[index];
  auto fail = [&](const std::string& problem) { throw GradientError("ZeroAdam: " + name + " got " + problem); };
  if (!grad.defined()) {
    fail("no gradient: its .grad is None after backward accumulated into it (did a hook set it to None?)");
  }
  if (grad.layout() != at::kStrided) {
    std::ostringstream s;
    s << "a sparse gradient (layout " << grad.layout() << "); ZeroAdam reduces dense gradients only: build "
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
  const at::Tensor& view = views_[index];
  if (grad.data_ptr() != view.data_ptr()) {
    view.copy_(grad);
    grad = view;
  }
}

void GradPath::fill(int64_t index, at::Tensor& grad) {
  if (!views_.empty()) {
    point_at_view(index, grad);
  } else {
    comm_.add_grad(bucket_[index], offset_[index], grad);
  }
  slot_[index] = Slot::kFilled;
  if (drop_grad_) grad.reset();
}

void GradPath::take(int64_t index) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(params_.size()), "GradPath.take: index ", index,
              " out of range");
  at::Tensor& grad = params_[index].mutable_grad();
  check_grad(index, grad);
  used_[index] = 1;
  if (keep_local) {  // .grad accumulates across the micro-batches; flush() hands it over
    if (!views_.empty()) point_at_view(index, grad);
    slot_[index] = Slot::kLocal;
    return;
  }
  if (slot_[index] == Slot::kFilled) {
    throw GradientError("ZeroAdam: " + names_[index] +
                        " got a second gradient before step(); call opt.step() after each backward, or run "
                        "the earlier backwards of an accumulated step inside `with opt.no_sync():`");
  }
  fill(index, grad);
  --missing_[bucket_[index]];
  if (overlap_) launch_ready();
}

void GradPath::launch_ready() {
  const int64_t n = static_cast<int64_t>(missing_.size());
  while (next_launch_ < n && missing_[next_launch_] == 0) {
    if (!before_launch_.is_none()) {
      py::gil_scoped_acquire gil;
      before_launch_(next_launch_);
    }
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
      at::Tensor& grad = params_[i].mutable_grad();
      if (slot_[i] == Slot::kLocal && grad.defined()) {
        check_grad(i, grad);  // user code may have replaced .grad since backward
        fill(i, grad);
      } else {  // no gradient here: it counts as zero ([Note: unused parameters] in grads.py)
        comm_.zero_slot(b, offset_[i], params_[i].numel());
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
  missing_ = bucket_params_;
  next_launch_ = 0;
}

void GradPath::begin_step() {
  std::fill(slot_.begin(), slot_.end(), Slot::kEmpty);
  missing_ = bucket_params_;
  next_launch_ = 0;
  std::fill(used_.begin(), used_.end(), 0);
  accumulate = false;
  in_backward = false;
}

}  // namespace zerofast
