// The module's Python bindings: the engines' classes (BucketComm, GradPath, the work keeper), the
// typed errors, and the callables the compiled core calls back; the one file that includes pybind11
// (every other source, the op schemas in ops.cpp included, compiles without Python's headers).
#include <torch/python.h>

#include "adam_cpu.h"
#include "buckets.h"
#include "grad_path.h"
#include "unit_pool.h"
#include "work_keeper.h"

namespace zerofast {

namespace cpu {
Isa selected_isa();
const char* isa_name(Isa isa);
}  // namespace cpu

bool has_cuda_kernels();  // ops.cpp

// The Python class GradientError is bound to (set at import), for the hook's errors.
PyObject* gradient_error_type = nullptr;

// A Python callable kept for the compiled core: its reference is dropped with the GIL taken, on
// whichever thread drops the last copy of the std::function holding it.
std::shared_ptr<py::object> keep_callable(py::object fn) {
  return std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* held) {
    py::gil_scoped_acquire gil;
    delete held;
  });
}

// GradPath's callbacks from Python's callables (None: none). The hook runs on autograd's thread
// without the GIL, so each call takes it; an exception the callable raises leaves as
// py::error_already_set, which autograd carries to backward()'s caller and torch raises as itself.
// See [Note: the gradient path] in grad_path.cpp.
GradPathCallbacks python_callbacks(py::object on_grad, py::object on_error, py::object before_launch) {
  GradPathCallbacks callbacks;
  if (!on_grad.is_none()) {
    callbacks.on_grad = [fn = keep_callable(std::move(on_grad))](int64_t index) {
      py::gil_scoped_acquire gil;
      (*fn)(index);
    };
  }
  if (!on_error.is_none()) {  // on_error(index, message) raises zerofast.comm.CollectiveError
    callbacks.on_comm_error = [fn = keep_callable(std::move(on_error))](int64_t index, const CommError& error) {
      py::gil_scoped_acquire gil;
      (*fn)(index, std::string(error.what()));
    };
  }
  if (!before_launch.is_none()) {
    callbacks.before_launch = [fn = keep_callable(std::move(before_launch))](int64_t bucket) {
      py::gil_scoped_acquire gil;
      (*fn)(bucket);
    };
  }
  // No pybind11 function surrounds the hook to translate a GradientError: raise the Python class.
  callbacks.on_gradient_error = [](const GradientError& error) {
    py::gil_scoped_acquire gil;
    py::set_error(gradient_error_type != nullptr ? gradient_error_type : PyExc_RuntimeError, error.what());
    throw py::error_already_set();
  };
  return callbacks;
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
  // GradientError is public: its class is zerofast.errors' (every public error in one home), which
  // this module raises for the C++ GradientError, and names as its own attribute too.
  py::object gradient_error = py::module_::import("zerofast.errors").attr("GradientError");
  m.attr("GradientError") = gradient_error;
  zerofast::gradient_error_type = gradient_error.release().ptr();  // kept for the module's lifetime
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const zerofast::GradientError& e) {
      py::set_error(zerofast::gradient_error_type, e.what());
    }
  });

  using zerofast::BucketComm;
  using zerofast::BucketCommOptions;
  using zerofast::BucketLayout;
  using zerofast::BucketPool;
  using zerofast::Collective;
  using zerofast::ReplicaReducer;
  using zerofast::StepTraffic;
  py::enum_<Collective>(m, "Collective", "The collective a bucket is reduced or gathered with (csrc/buckets.h)")
      .value("all_reduce", Collective::kAllReduce)
      .value("reduce_scatter", Collective::kReduceScatter)
      .value("reduce", Collective::kReduce)
      .value("all_gather", Collective::kAllGather)
      .value("broadcast", Collective::kBroadcast);
  // The options structs are filled field by field (their comments are in csrc/bucket_layout.h and
  // csrc/buckets.h); a field set to a value of the wrong type raises TypeError naming it.
  py::class_<BucketLayout>(m, "BucketLayout", "One process group's buckets (see csrc/bucket_layout.h)")
      .def(py::init<>())
      .def_readwrite("bucket_numels", &BucketLayout::bucket_numels)
      .def_readwrite("used_numels", &BucketLayout::used_numels)
      .def_readwrite("bounds", &BucketLayout::bounds)
      .def_readwrite("shard_offsets", &BucketLayout::shard_offsets)
      .def_readwrite("flat", &BucketLayout::flat);
  py::class_<BucketCommOptions>(m, "BucketCommOptions", "What a BucketComm is built from (see csrc/buckets.h)")
      .def(py::init<>())
      .def_readwrite("group", &BucketCommOptions::group)
      .def_readwrite("gather_group", &BucketCommOptions::gather_group)
      .def_readwrite("layout", &BucketCommOptions::layout)
      .def_readwrite("reduce_op", &BucketCommOptions::reduce_op)
      .def_readwrite("gather_op", &BucketCommOptions::gather_op)
      .def_readwrite("grad_shard", &BucketCommOptions::grad_shard)
      .def_readwrite("grad_buckets", &BucketCommOptions::grad_buckets)
      .def_readwrite("max_buffers", &BucketCommOptions::max_buffers);
  // The parts below are reached through their BucketComm (which they live in), never built alone.
  py::class_<BucketPool>(m, "BucketPool", "The bucket buffers and their counts (see csrc/bucket_pool.h)")
      .def_property_readonly("bytes_in_use", &BucketPool::bytes_in_use)
      .def_property_readonly("peak_bytes", &BucketPool::peak_bytes)
      .def_property_readonly("kept_bytes", &BucketPool::kept_bytes)
      .def_property_readonly("live", &BucketPool::live)
      .def_property_readonly("peak_live", &BucketPool::peak_live)
      .def_property_readonly("peak_alive", &BucketPool::peak_alive)
      .def_property_readonly("over_budget", &BucketPool::over_budget)
      .def_property_readonly("max_buffers", &BucketPool::max_buffers)
      .def("reset_peak", &BucketPool::reset_peak);
  py::class_<ReplicaReducer>(m, "ReplicaReducer",
                             "Hybrid sharding's all_reduce over the replicas (see csrc/replica_reducer.h)")
      .def("set_group", &ReplicaReducer::set_group, py::arg("group"), py::arg("min_bytes"), py::arg("coalesce") = true)
      .def("set_last_micro_batch", &ReplicaReducer::set_last_micro_batch, py::arg("last"))
      .def_property_readonly("bytes", &ReplicaReducer::bytes);
  py::class_<StepTraffic>(m, "StepTraffic", "This step's reduces and gathers, counted (see csrc/buckets.h)")
      .def_property_readonly("reduce_bytes", &StepTraffic::reduce_bytes)
      .def_property_readonly("gather_bytes", &StepTraffic::gather_bytes)
      .def_property_readonly("reduce_hash", &StepTraffic::reduce_hash)
      .def_property_readonly("gather_hash", &StepTraffic::gather_hash);
  py::class_<BucketComm>(m, "BucketComm", "The reduce/gather core of the gradient buckets (see csrc/buckets.h)")
      .def(py::init<BucketCommOptions>(), py::arg("options"))
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
      .def("new_step", &BucketComm::new_step)
      // Properties return their part by reference, kept alive by the BucketComm.
      .def_property_readonly("pool", py::overload_cast<>(&BucketComm::pool))
      .def_property_readonly("replicas", &BucketComm::replicas)
      .def_property_readonly("traffic", &BucketComm::traffic);

  // Every Work from issue to release ([Note: clean exit] in csrc/work_keeper.cpp): Python's own
  // collectives (zerofast/comm.py) hand theirs over too; its atexit drains them.
  py::class_<zerofast::DrainReport>(m, "DrainReport", "What drain_kept_works found (see csrc/work_keeper.h)")
      .def_readonly("waited", &zerofast::DrainReport::waited)
      .def_readonly("failed", &zerofast::DrainReport::failed)
      .def_readonly("held", &zerofast::DrainReport::held)
      .def_readonly("errors", &zerofast::DrainReport::errors);
  m.def("keep_work", &zerofast::keep_work, py::arg("work"), py::call_guard<py::gil_scoped_release>(),
        "Keep a Work until nobody else holds it, then release it on one of our threads");
  m.def("release_kept_works", &zerofast::release_kept_works, py::call_guard<py::gil_scoped_release>(),
        "Release the kept Works nobody else holds; how many are still held elsewhere");
  m.def(
      "drain_kept_works",
      [](double limit_s) {
        return zerofast::drain_kept_works(std::chrono::milliseconds(static_cast<int64_t>(limit_s * 1000)));
      },
      py::arg("limit_s"), py::call_guard<py::gil_scoped_release>(),
      "At exit: wait for the kept Works in flight (limit_s in all), release those done, keep the rest for good");

  // Stage 3's unit buffers on the CPU ([Note: unit buffer pool] in csrc/unit_pool.cpp).
  m.def("pool_unit_storage", &zerofast::pool_unit_storage, py::arg("buffer"), py::arg("limit"),
        "The buffer's storage allocates through the unit pool, which keeps up to `limit` bytes released");
  m.def(
      "unit_pool_stats",
      [] {
        auto s = zerofast::unit_pool_stats();
        return py::dict(py::arg("kept_bytes") = s.kept_bytes, py::arg("limit") = s.limit,
                        py::arg("allocated") = s.allocated, py::arg("reused") = s.reused);
      },
      "The unit pool's bytes kept, limit, allocations from the system and reuses");

  using zerofast::GradPath;
  py::class_<GradPath>(m, "GradPath", "The per-gradient path of phase 1 and its state (see csrc/grad_path.h)")
      // Python's callables become the core's std::functions here (python_callbacks).
      .def(py::init([](BucketComm& comm, std::vector<at::Tensor> params, std::vector<std::string> names,
                       std::vector<int64_t> bucket, std::vector<int64_t> offset, std::vector<int64_t> bucket_params,
                       std::vector<at::Tensor> views, bool drop_grad, bool overlap, py::object on_grad,
                       py::object on_error, py::object before_launch, std::string who) {
             zerofast::GradPathOptions options{
                 std::move(params), std::move(names), std::move(bucket), std::move(offset), std::move(bucket_params),
                 std::move(views),  drop_grad,        overlap,           std::move(who)};
             return std::make_unique<GradPath>(
                 comm, std::move(options),
                 zerofast::python_callbacks(std::move(on_grad), std::move(on_error), std::move(before_launch)));
           }),
           py::arg("comm"), py::arg("params"), py::arg("names"), py::arg("bucket"), py::arg("offset"),
           py::arg("bucket_params"), py::arg("views"), py::arg("drop_grad"), py::arg("overlap"), py::arg("on_grad"),
           py::arg("on_error"), py::arg("before_launch"), py::arg("who") = "ZeroAdam",
           py::keep_alive<1, 2>())  // the BucketComm outlives the path
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
