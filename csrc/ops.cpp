// Every op schema of the zerofast library (TORCH_LIBRARY), and the module's Python bindings.
// Backend files only add their TORCH_LIBRARY_IMPL; nothing else spells a signature.
#include <torch/extension.h>
#include <torch/library.h>

#include "adam_cpu.h"
#include "buckets.h"
#include "grad_path.h"

namespace zerofast {

namespace cpu {
Isa selected_isa();
const char* isa_name(Isa isa);
}  // namespace cpu

TORCH_LIBRARY(zerofast, m) {
  // One Adam/AdamW step on flat fp32 master state; see adam_math.h for the math and
  // zerofast/_ops.py for the Python face and the fake kernel. Mutates param, exp_avg, exp_avg_sq,
  // and found_inf / param_copy when given; returns nothing.
  m.def(
      "fused_adam_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, *, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool adamw, "
      "float grad_scale, Tensor? grad_scale_tensor, Tensor(d!)? found_inf, Tensor(e!)? param_copy) -> ()");
  // fused_adam_'s step with 8-bit moments ([Note: quantized state] in zerofast/quant.py): exp_avg and
  // exp_avg_sq are uint8 code indices, exp_avg_scale and exp_avg_sq_scale one float32 per `block`
  // elements, exp_avg_code and exp_avg_sq_code the 256 values of each code. Mutates param, the
  // moments, their scales, and found_inf / param_copy when given; returns nothing.
  m.def(
      "fused_adam_8bit_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!) exp_avg_scale, Tensor(e!) exp_avg_sq_scale, Tensor exp_avg_code, Tensor exp_avg_sq_code, *, "
      "int block, float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool adamw, "
      "float grad_scale, Tensor? grad_scale_tensor, Tensor(f!)? found_inf, Tensor(g!)? param_copy) -> ()");
  // Sets found_inf (a 1-element float32 tensor) to 1 when any value of grad is inf or nan, with the
  // same check fused_adam_ runs before its update; leaves it alone otherwise. ZeroAdam runs it on
  // each rank's gradient shard so the ranks can agree on skipping a step before any rank updates.
  m.def("nonfinite_check_(Tensor grad, Tensor(a!) found_inf) -> ()");
}

#ifndef ZEROFAST_WITH_CUDA
namespace {
// Without this, a CUDA tensor would meet the dispatcher's generic "could not run ... CUDA backend".
void fused_adam_cuda_missing(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                             double, double, double, int64_t, bool, double, const std::optional<at::Tensor>&,
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false,
              "fused_adam_: got CUDA tensors, but zerofast was built without its CUDA kernels "
              "(zerofast.has_cuda_kernels() is False); rebuild with ZEROFAST_CUDA=1");
}
void fused_adam_8bit_cuda_missing(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                  double, double, double, double, double, int64_t, bool, double,
                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                  const std::optional<at::Tensor>&) {
  TORCH_CHECK(false,
              "fused_adam_8bit_: got CUDA tensors, but zerofast was built without its CUDA kernels "
              "(zerofast.has_cuda_kernels() is False); rebuild with ZEROFAST_CUDA=1");
}
void nonfinite_check_cuda_missing(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false,
              "nonfinite_check_: got CUDA tensors, but zerofast was built without its CUDA kernels "
              "(zerofast.has_cuda_kernels() is False); rebuild with ZEROFAST_CUDA=1");
}
}  // namespace
TORCH_LIBRARY_IMPL(zerofast, CUDA, m) {
  m.impl("fused_adam_", &fused_adam_cuda_missing);
  m.impl("fused_adam_8bit_", &fused_adam_8bit_cuda_missing);
  m.impl("nonfinite_check_", &nonfinite_check_cuda_missing);
}
#endif

bool has_cuda_kernels() {
#ifdef ZEROFAST_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace zerofast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zerofast's compiled core: fused Adam kernels and bucketed collectives";
  m.def("has_cuda_kernels", &zerofast::has_cuda_kernels, "Whether the CUDA kernels were built");
  m.def(
      "cpu_isa", [] { return std::string(zerofast::cpu::isa_name(zerofast::cpu::selected_isa())); },
      "The instruction set whose CPU loop fused_adam_ runs now (ZEROFAST_CPU_ISA may force one)");

  // The errors that cross the boundary, by kind (csrc/errors.h): both subclass RuntimeError.
  auto& comm_error = py::register_exception<zerofast::CommError>(m, "CommError", PyExc_RuntimeError);
  comm_error.attr("__doc__") =
      "A collective of the compiled engine, or the wait for one, failed (c10d's error, "
      "with its message); zerofast.comm turns it into CollectiveError";
  auto& gradient_error = py::register_exception<zerofast::GradientError>(m, "GradientError", PyExc_RuntimeError);
  gradient_error.attr("__doc__") =
      "A gradient ZeroAdam cannot take (sparse, or of another dtype, device or shape than "
      "its parameter, or a second one before step()), named by its parameter";
  zerofast::gradient_error_type = gradient_error.ptr();

  using zerofast::BucketComm;
  using zerofast::Collective;
  py::enum_<Collective>(m, "Collective", "The collective a bucket is reduced or gathered with (csrc/buckets.h)")
      .value("all_reduce", Collective::kAllReduce)
      .value("reduce_scatter", Collective::kReduceScatter)
      .value("reduce", Collective::kReduce)
      .value("all_gather", Collective::kAllGather)
      .value("broadcast", Collective::kBroadcast);
  py::class_<BucketComm>(m, "BucketComm", "Flat gradient buckets and their collectives (see csrc/buckets.h)")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, c10::intrusive_ptr<c10d::ProcessGroup>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<std::vector<int64_t>>, bool, at::Tensor,
                    std::vector<int64_t>, Collective, Collective, std::vector<at::Tensor>, int64_t>(),
           py::arg("group"), py::arg("gather_group"), py::arg("bucket_numels"), py::arg("used_numels"),
           py::arg("bounds"), py::arg("flat"), py::arg("grad_shard"), py::arg("shard_offsets"), py::arg("reduce_op"),
           py::arg("gather_op"), py::arg("grad_buckets"), py::arg("max_buffers"))
      // Every method that may wait for a collective releases the GIL: a gloo worker thread that
      // drops the last C++ reference to a tensor Python also holds must take the GIL to decref it,
      // so waiting with the GIL held can deadlock (it did: add_grad waiting for an in-flight reduce).
      .def("add_grad", &BucketComm::add_grad, py::arg("bucket"), py::arg("offset"), py::arg("grad"),
           py::call_guard<py::gil_scoped_release>())
      .def("zero_slot", &BucketComm::zero_slot, py::arg("bucket"), py::arg("offset"), py::arg("numel"),
           py::call_guard<py::gil_scoped_release>())
      .def("reduce", &BucketComm::reduce, py::arg("bucket"), py::arg("accumulate"),
           py::call_guard<py::gil_scoped_release>())
      .def("wait_reduces", &BucketComm::wait_reduces, py::call_guard<py::gil_scoped_release>())
      .def("gather_start", &BucketComm::gather_start, py::arg("bucket"), py::arg("param_buffer"),
           py::call_guard<py::gil_scoped_release>())
      .def("gather_wait", &BucketComm::gather_wait, py::arg("bucket"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("buffer_bytes", &BucketComm::buffer_bytes)
      .def_property_readonly("peak_buffer_bytes", &BucketComm::peak_buffer_bytes)
      .def_property_readonly("pooled_bytes", &BucketComm::pooled_bytes)
      .def_property_readonly("live_buffers", &BucketComm::live_buffers)
      .def_property_readonly("peak_live_buffers", &BucketComm::peak_live_buffers)
      .def_property_readonly("peak_alive_buffers", &BucketComm::peak_alive_buffers)
      .def_property_readonly("over_budget", &BucketComm::over_budget)
      .def_property_readonly("max_buffers", &BucketComm::max_buffers)
      .def("reset_peak", &BucketComm::reset_peak)
      .def_property_readonly("reduce_bytes", &BucketComm::reduce_bytes)
      .def_property_readonly("gather_bytes", &BucketComm::gather_bytes)
      .def_property_readonly("reduce_hash", &BucketComm::reduce_hash)
      .def_property_readonly("gather_hash", &BucketComm::gather_hash)
      .def("reset_counts", &BucketComm::reset_counts)
      .def("set_replicate_group", &BucketComm::set_replicate_group, py::arg("group"), py::arg("min_bytes"))
      .def("set_replicate", &BucketComm::set_replicate, py::arg("on"))
      .def_property_readonly("replicate_bytes", &BucketComm::replicate_bytes);

  using zerofast::GradPath;
  py::class_<GradPath>(m, "GradPath", "The per-gradient path of phase 1 and its state (see csrc/grad_path.h)")
      .def(py::init<BucketComm&, std::vector<at::Tensor>, std::vector<std::string>, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>, bool, bool, py::object,
                    py::object, py::object>(),
           py::arg("comm"), py::arg("params"), py::arg("names"), py::arg("bucket"), py::arg("offset"),
           py::arg("bucket_params"), py::arg("views"), py::arg("drop_grad"), py::arg("overlap"), py::arg("on_grad"),
           py::arg("on_error"), py::arg("before_launch"), py::keep_alive<1, 2>())  // the BucketComm outlives the path
      // May wait for a reduce (add_grad, launches): without the GIL, as BucketComm's own methods.
      .def("take", &GradPath::take, py::arg("index"), py::call_guard<py::gil_scoped_release>())
      .def("launch_ready", &GradPath::launch_ready, py::call_guard<py::gil_scoped_release>())
      .def("flush", &GradPath::flush, py::call_guard<py::gil_scoped_release>())
      .def("begin_micro_batch", &GradPath::begin_micro_batch)
      .def("begin_step", &GradPath::begin_step)
      .def("remove_hooks", &GradPath::remove_hooks)
      .def("used", &GradPath::used)
      .def_property_readonly("next_launch", &GradPath::next_launch)
      .def_readwrite("python_decides", &GradPath::python_decides)
      .def_readwrite("keep_local", &GradPath::keep_local)
      .def_readwrite("accumulate", &GradPath::accumulate)
      .def_readwrite("in_backward", &GradPath::in_backward)
      .def_readonly("fast_calls", &GradPath::fast_calls);
}
