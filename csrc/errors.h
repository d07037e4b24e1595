// The errors the compiled core throws across the boundary to Python, one class per kind, so that
// Python never tells them apart by their text. bindings.cpp binds each to a Python class
// (py::register_exception; both subclass RuntimeError):
//   CommError      zerofast._C.CommError: a collective, or the wait for one, failed: c10d's own
//                  exception (gloo's "Connection closed by peer", a timeout), rethrown with its
//                  message by comm_call. zerofast/comm.py turns it into CollectiveError, which
//                  names the step, the phase and the collective, and says a peer failed.
//   GradientError  zerofast._C.GradientError (exported as zerofast.comm.GradientError): a gradient
//                  the optimizer cannot take (sparse, of another dtype, device or shape than its
//                  parameter, or a second one before step()), named by its parameter, raised on
//                  the rank where it arrived. Nothing was communicated for it.
// Anything else (running out of memory, a broken invariant: TORCH_CHECK) crosses as torch's own
// errors do, as itself: never as a failed peer.
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace zerofast {

class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class GradientError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs one c10d call: issuing a collective, waiting for one, asking whether one completed. Any
// exception it throws, except running out of memory, is the communication's and becomes a
// CommError with the backend's message (without c10's backtrace).
template <typename F>
decltype(auto) comm_call(F&& call) {
  try {
    return std::forward<F>(call)();
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    throw CommError(e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw CommError(e.what());
  }
}

}  // namespace zerofast
