// See grad_path.h and [Note: the gradient path] in zerofast/grads.py.
#include "grad_path.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace py = pybind11;

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

}  // namespace

GradPath::GradPath(BucketComm& comm, std::vector<at::Tensor> params, std::vector<int64_t> bucket,
                   std::vector<int64_t> offset, std::vector<int64_t> bucket_params, std::vector<at::Tensor> views,
                   bool drop_grad, bool overlap, py::object on_grad, py::object on_error)
    : used(params.size(), 0),
      got_grad(params.size(), 0),
      missing(bucket_params),
      comm_(comm),
      params_(std::move(params)),
      bucket_(std::move(bucket)),
      offset_(std::move(offset)),
      bucket_params_(std::move(bucket_params)),
      views_(std::move(views)),
      drop_grad_(drop_grad),
      overlap_(overlap),
      on_grad_(std::move(on_grad)),
      on_error_(std::move(on_error)) {
  const size_t n = params_.size();
  TORCH_CHECK(bucket_.size() == n && offset_.size() == n && (views_.empty() || views_.size() == n),
              "GradPath: bucket (", bucket_.size(), "), offset (", offset_.size(), ") and views (", views_.size(),
              ") need one entry per parameter (", n, ")");
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(params_[i].requires_grad(), "GradPath: parameter ", i, " does not require grad");
    TORCH_CHECK(bucket_[i] >= 0 && bucket_[i] < static_cast<int64_t>(bucket_params_.size()), "GradPath: parameter ",
                i, " has bucket ", bucket_[i], " of ", bucket_params_.size());
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

void GradPath::on_hook(int64_t index) {
  if (python_decides || !in_backward || got_grad[index]) {
    py::gil_scoped_acquire gil;
    on_grad_(index);
    return;
  }
  try {
    used[index] = 1;
    accept(index);
    ++fast_calls;
  } catch (const std::exception& e) {
    py::gil_scoped_acquire gil;
    // Raises zerofast.comm.CollectiveError for the backend's errors (is_comm_failure), any other
    // error as a RuntimeError naming the parameter.
    on_error_(index, std::string(e.what()));
    throw;
  }
}

void GradPath::accept(int64_t index) {
  const at::Tensor& param = params_[index];
  const int64_t b = bucket_[index];
  at::Tensor& grad = param.mutable_grad();
  TORCH_CHECK(grad.defined(), "GradPath: parameter ", index, " has no gradient to accept");
  if (!views_.empty()) {  // stage 1: .grad is the slot ([Note: grads as bucket views])
    const at::Tensor& view = views_[index];
    if (grad.data_ptr() != view.data_ptr()) {
      view.copy_(grad);
      grad = view;
    }
  } else {
    comm_.add_grad(b, offset_[index], grad);
  }
  got_grad[index] = 1;
  if (drop_grad_) grad.reset();
  --missing[b];
  if (overlap_ && !python_decides) launch_ready();
}

void GradPath::launch_ready() {
  const int64_t n = static_cast<int64_t>(missing.size());
  while (next_launch < n && missing[next_launch] == 0) {
    RECORD_FUNCTION("zerofast::reduce", std::vector<c10::IValue>());
    comm_.reduce(next_launch, accumulate);
    ++next_launch;
  }
}

void GradPath::fill_rest() {
  for (size_t i = 0; i < got_grad.size(); ++i) {
    if (bucket_[i] >= next_launch) got_grad[i] = 1;
  }
  for (int64_t b = next_launch; b < static_cast<int64_t>(missing.size()); ++b) missing[b] = 0;
}

void GradPath::begin_micro_batch() {
  std::fill(got_grad.begin(), got_grad.end(), 0);
  missing = bucket_params_;
  next_launch = 0;
}

void GradPath::begin_step() {
  begin_micro_batch();
  std::fill(used.begin(), used.end(), 0);
  accumulate = false;
  in_backward = false;
}

}  // namespace zerofast
