// See work_keeper.h.
#include "work_keeper.h"

#include <ATen/ThreadLocalPythonObjects.h>

#include <algorithm>
#include <mutex>

namespace zerofast {

// [Note: clean exit]
// What failed: a finished job whose rank died with SIGABRT ("terminate called without an active
// exception") after its last step. A c10d Work holds what was current when it was issued (gloo's
// AsyncWork keeps an at::ThreadLocalState, which from torch 2.14 holds the contextvars context that
// autograd stashes in thread-local state for every backward, a Python object) and its tensors
// (which may own a Python object). Whoever drops a Work's last reference runs those destructors,
// and a Python object's needs the GIL. gloo's worker thread holds each Work while it runs it and
// drops its reference just after marking it complete, so when the issuer has already dropped its
// own (it waited, and went on), the worker drops the last one: it waits for the GIL, and if the
// main thread meanwhile enters Py_FinalizeEx, CPython ends the waiting thread (PyThread_exit_thread)
// inside a C++ destructor, and std::terminate aborts the process. DDP's reducer never shows it: it
// holds its last Works until the next backward, so they die with it, on the main thread.
// What we do:
// 1. issue(): a collective is issued with the thread's Python objects set aside
//    (NoPythonObjectsInThreadState), so a Work of ours carries none of autograd's (torch keeps
//    other Python state there too: dispatch modes, saved-tensor hooks; those stay, and 2. covers
//    them).
// 2. keep_work(): every Work is kept from its issue until nobody else holds it (use_count() == 1:
//    neither its issuer nor its backend), and released then, on our thread: at the next issue, after
//    each wait (release_kept_works), or at exit. No backend thread ever drops the last reference to
//    a Work of ours. Python's own collectives (zerofast/comm.py) are kept the same way.
// 3. drain_kept_works(), from Python's atexit (zerofast/exit_drain.py; atexit runs before finalization):
//    what is still in flight (an overlapped parameter gather, stage 3's prefetch, a reduce of a
//    backward whose step never came) is waited for, at most a few seconds in all (the peers are
//    finishing the same step; a peer that died or is stuck must not hold this exit for a process
//    group's timeout), and released here. A Work still running then, or that someone else still
//    holds (a live optimizer's, or its backend's in the moment after completing it), is kept for
//    good: the keeper is never destroyed, so the last reference is never the backend's, and what a
//    live optimizer drops at finalization is not the last one either (and torch skips Python's
//    decrefs once finalization has begun).
// 4. Then, still in atexit (backend_threads_settled in zerofast/exit_drain.py): the Works zerofast did
//    not issue. torch's object collectives (DCP's plans and barriers in a save, all_gather_object in
//    the main job's report, a user's own all_reduce) are waited for by their issuer, but gloo's
//    worker drops its reference a moment after completing each, and a tensor whose Python object
//    died meanwhile (all_gather_object's own) now owns that object. On a loaded machine the moment
//    can outlast the program (a loaded CI run saw `zerofast.train`'s rank 1 abort at exit once with
//    1-3 above in place: no Work of ours was left to drop, which leaves these). So the exit waits
//    until none of c10d's gloo worker threads ("pt_gloo_runloop") is runnable (Linux: preempted
//    before its drop shows as R), 1 s at most, letting go of the GIL meanwhile. A collective of
//    someone else's still in flight at exit (issued async_op=True and never waited for) is beyond
//    it: that worker is blocked, not runnable, until its peers join.
// The asynchronous checkpoint writer's thread is joined before atexit runs
// (zerofast/checkpoint/background.py). Tested by tests/test_exit.py; measured by
// scripts/exit_check.sh (docs/testing.md).

struct NoPythonObjectsInThreadState::Saved {
  at::impl::ThreadLocalPythonObjects objects;
};

NoPythonObjectsInThreadState::NoPythonObjectsInThreadState()
    : saved_(new Saved{at::impl::ThreadLocalPythonObjects::get_state()}) {
  // The copy above holds every object, so clearing the thread's map drops no last reference.
  at::impl::ThreadLocalPythonObjects::set_state(at::impl::ThreadLocalPythonObjects());
}

NoPythonObjectsInThreadState::~NoPythonObjectsInThreadState() {
  at::impl::ThreadLocalPythonObjects::set_state(std::move(saved_->objects));
  delete saved_;
}

namespace {

struct Keeper {
  std::mutex mutex;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<c10::intrusive_ptr<c10d::Work>> for_good;  // held by their backend past the exit's limit
};

// Never destroyed: a static destructor would drop the Works it still holds after finalization, on
// whichever thread runs it, in no order with c10d's own.
Keeper& keeper() {
  static Keeper* instance = new Keeper();
  return *instance;
}

// Whether nobody but the keeper holds the Work and it is complete (NCCL's watchdog holds a copy of
// its Work, not a reference, so the count alone does not say the collective is over). A Work whose
// completion cannot be asked failed: it is over too.
bool done_with(const c10::intrusive_ptr<c10d::Work>& work) {
  if (work.use_count() != 1) return false;
  try {
    return work->isCompleted();
  } catch (const std::exception&) {
    return true;
  }
}

// The Works the keeper is done with, taken out under the lock; the caller releases them after
// unlocking (a release may take the GIL, and a thread holding the GIL may be waiting for the lock).
std::vector<c10::intrusive_ptr<c10d::Work>> take_released(Keeper& k) {
  std::vector<c10::intrusive_ptr<c10d::Work>> released;
  size_t kept = 0;
  for (auto& work : k.works) {
    if (done_with(work)) {
      released.push_back(std::move(work));
    } else {
      k.works[kept++] = std::move(work);
    }
  }
  k.works.resize(kept);
  return released;
}

}  // namespace

void keep_work(c10::intrusive_ptr<c10d::Work> work) {
  if (!work) return;
  Keeper& k = keeper();
  std::vector<c10::intrusive_ptr<c10d::Work>> released;
  {
    std::lock_guard<std::mutex> lock(k.mutex);
    released = take_released(k);
    k.works.push_back(std::move(work));
  }
}  // `released` dies here, outside the lock

int64_t release_kept_works() {
  Keeper& k = keeper();
  std::vector<c10::intrusive_ptr<c10d::Work>> released;
  int64_t held;
  {
    std::lock_guard<std::mutex> lock(k.mutex);
    released = take_released(k);
    held = static_cast<int64_t>(k.works.size());
  }
  released.clear();
  return held;
}

DrainReport drain_kept_works(std::chrono::milliseconds limit) {
  Keeper& k = keeper();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    std::lock_guard<std::mutex> lock(k.mutex);
    works.swap(k.works);
  }
  DrainReport report;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<c10::intrusive_ptr<c10d::Work>> held;
  for (auto& work : works) {
    if (done_with(work)) continue;  // released below
    bool complete = false;
    try {
      complete = work->isCompleted();
      if (!complete) {
        ++report.waited;
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        complete = work->wait(std::max(left, std::chrono::milliseconds(1)));
      }
    } catch (const std::exception& e) {  // failed, or still running at the deadline (c10d throws then)
      ++report.failed;
      report.errors.emplace_back(e.what());
    }
    // Complete and ours alone: released below. Else kept for good, so that whoever drops it later
    // (its backend, when it completes or fails) does not drop the last reference.
    if (!complete || work.use_count() != 1) held.push_back(std::move(work));
  }
  works.clear();
  report.held = static_cast<int64_t>(held.size());
  std::lock_guard<std::mutex> lock(k.mutex);
  for (auto& work : held) k.for_good.push_back(std::move(work));
  return report;
}

}  // namespace zerofast
