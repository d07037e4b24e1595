// Every collective zerofast issues, from issue to release: issued with no Python object in the
// thread-local state its Work captures, kept until its backend has let go of it, released on one of
// our threads, and at the interpreter's exit waited for before finalization. See [Note: clean exit]
// in work_keeper.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>
#include <vector>

#include "errors.h"

namespace zerofast {

// Clears the Python objects torch keeps in this thread's state (at::impl::ThreadLocalPythonObjects:
// from torch 2.14 the contextvars context autograd stashes for the length of every backward) for
// its scope, restoring them after. A Work captures the thread's state when it is issued.
class NoPythonObjectsInThreadState {
 public:
  NoPythonObjectsInThreadState();
  ~NoPythonObjectsInThreadState();
  NoPythonObjectsInThreadState(const NoPythonObjectsInThreadState&) = delete;
  NoPythonObjectsInThreadState& operator=(const NoPythonObjectsInThreadState&) = delete;

 private:
  struct Saved;
  Saved* saved_;
};

// Hands a Work over to the keeper, which releases it once it is complete and nobody else holds it.
void keep_work(c10::intrusive_ptr<c10d::Work> work);

// Issues one collective: `call` returns its Work (a c10d call), which is issued as comm_call does
// (errors.h: a failure is a CommError) with no Python object in the thread's state, and kept.
template <typename F>
c10::intrusive_ptr<c10d::Work> issue(F&& call) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    NoPythonObjectsInThreadState clean;
    work = comm_call(std::forward<F>(call));
  }
  keep_work(work);
  return work;
}

// Releases every kept Work that is complete and that only the keeper still holds (on the calling
// thread); returns how many are kept still (held elsewhere, by their issuer or their backend, or in
// flight).
int64_t release_kept_works();

// What draining found: the Works still in flight that were waited for, those whose wait failed or
// ran out of time (with the backend's words), and those kept for good (still running, or held by
// someone else).
struct DrainReport {
  int64_t waited = 0;
  int64_t failed = 0;
  int64_t held = 0;
  std::vector<std::string> errors;
};

// At the interpreter's exit, before finalization: waits for every kept Work still in flight, for
// `limit` in all, releases here those complete that nobody else holds, and keeps the others for
// good (see [Note: clean exit]).
DrainReport drain_kept_works(std::chrono::milliseconds limit);

}  // namespace zerofast
