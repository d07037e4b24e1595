// See replica_reducer.h; [Note: replicas in backward] is at set_group().
#include "replica_reducer.h"

#include <algorithm>

#include "errors.h"
#include "work_keeper.h"

namespace zerofast {

ReplicaReducer::ReplicaReducer(const OwnedGrads& owned, int64_t num_buckets)
    : owned_(&owned), last_reduce_(num_buckets, false), due_(num_buckets, false) {}

// [Note: replicas in backward]
// Hybrid sharding ([Note: hybrid sharding] in zerofast/topology.py) sums each owned gradient range
// over the replicas once per step, after the range holds the shard group's sum of the step. Done
// in step() it would wait for the whole backward; here a bucket's range is all_reduced over the
// replicate group as soon as its last reduce of the step is finished (when backward needs its
// buffer, at the next launch's reap, or at wait_reduces), so it overlaps the rest of backward as
// the reduces do. "Last": launched after set_last_micro_batch(true), which Python sets outside
// no_sync(), so the micro-batches accumulating into the shard under no_sync() never cross machines.
// Replicas pair their all_reduces by order, and a reduce may finish out of order (gloo runs
// collectives on several threads), so they are launched strictly in bucket order: bucket b's waits
// for every bucket before it. Owned ranges are 1/K of a bucket, and a ring over many replicas pays
// its latency per call, so consecutive ranges (adjacent in grad_shard) go in one all_reduce until
// it holds min_bytes (the shard group's bucket size); stage 1's ranges sit in separate buckets, and
// go together as one coalesced all_reduce.
// wait_reduces launches whatever is left (the last ranges, a bucket whose last reduce was under
// no_sync), waits for all, and the step's agreement and Adam then read the replicated sum. The
// core (buckets.cpp) makes every call that launches or waits with the comm stream current
// ([Note: comm stream]), as its own reduces.
void ReplicaReducer::set_group(c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t min_bytes, bool coalesce) {
  TORCH_CHECK(group, "ReplicaReducer.set_group: a process group is needed");
  TORCH_CHECK(min_bytes >= 0, "ReplicaReducer.set_group: min_bytes must be >= 0; got ", min_bytes);
  group_ = std::move(group);
  min_bytes_ = min_bytes;
  coalesce_ = coalesce;
}

void ReplicaReducer::reduce_finished(int64_t bucket) {
  if (group_ && last_reduce_[bucket]) {
    due_[bucket] = true;
    last_reduce_[bucket] = false;
  }
  launch_due();
}

void ReplicaReducer::launch_due() {
  while (next_ < static_cast<int64_t>(due_.size()) && due_[next_]) launch(next_++);
}

void ReplicaReducer::launch(int64_t bucket) {
  const int64_t numel = owned_->numel(bucket);
  if (numel == 0) return;      // the same on every replica: they hold the same shard
  if (owned_->persistent()) {  // stage 1: this bucket's owned range, where the reduce left it
    pending_ranges_.push_back(owned_->range(bucket));
  } else {  // grad_shard: the pending ranges and this one are adjacent (bucket order)
    if (pending_numel_ == 0) pending_lo_ = owned_->shard_offset(bucket);
  }
  pending_numel_ += numel;
  if (pending_numel_ * owned_->shard().element_size() >= min_bytes_) flush();
}

void ReplicaReducer::flush() {
  if (pending_numel_ == 0) return;
  std::vector<at::Tensor> ranges =
      owned_->persistent() ? std::move(pending_ranges_)
                           : std::vector<at::Tensor>{owned_->shard().narrow(0, pending_lo_, pending_numel_)};
  pending_ranges_.clear();
  pending_numel_ = 0;
  all_reduce(std::move(ranges));
}

void ReplicaReducer::all_reduce(std::vector<at::Tensor> ranges) {
  for (const auto& r : ranges) bytes_ += r.numel() * r.element_size();
  if (ranges.size() == 1 || !coalesce_) {
    for (auto& range : ranges) {
      std::vector<at::Tensor> one{range};
      works_.push_back(issue([&] { return group_->allreduce(one, c10d::AllreduceOptions()); }));
    }
  } else {
    works_.push_back(issue([&] { return group_->allreduce_coalesced(ranges, c10d::AllreduceCoalescedOptions()); }));
  }
}

void ReplicaReducer::finish_step() {
  while (next_ < static_cast<int64_t>(due_.size())) launch(next_++);
  flush();
  for (auto& work : works_) comm_call([&] { return work->wait(); });
  works_.clear();
  release_kept_works();  // see [Note: clean exit] in work_keeper.cpp
}

void ReplicaReducer::new_step() {
  bytes_ = 0;
  std::fill(due_.begin(), due_.end(), false);
  next_ = 0;
  pending_numel_ = 0;
  pending_ranges_.clear();
  // Nothing is in flight at a new step, unless the last one ended in an error before wait_reduces:
  // its launches are not this step's.
  std::fill(last_reduce_.begin(), last_reduce_.end(), false);
  works_.clear();
}

}  // namespace zerofast
