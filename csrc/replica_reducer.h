// Hybrid sharding's gradient all_reduce over the replicas ([Note: replicas in backward] in
// replica_reducer.cpp): each owned range, once its bucket's last reduce of the step is finished,
// summed over the ranks holding the same shard in the other shard groups, in bucket order, small
// ranges together. The reduce/gather core (buckets.h) tells it when a reduce is launched and
// finished and calls it with the comm stream current; it issues and waits for its own all_reduces.
// A failure of a c10d call is thrown as CommError (errors.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "bucket_layout.h"

namespace zerofast {

class ReplicaReducer {
 public:
  // owned: where the owned ranges live (the core's, which outlives this); without set_group() it
  // does nothing.
  ReplicaReducer(const OwnedGrads& owned, int64_t num_buckets);

  // group: the ranks holding this rank's shard in the other shard groups; min_bytes: consecutive
  // owned ranges are all_reduced together until they hold at least this; coalesce: stage 1's
  // separate ranges in one allreduce_coalesced (false: one allreduce per range, for a group that
  // takes one tensor per call, as torchft's managed group).
  void set_group(c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t min_bytes, bool coalesce = true);
  bool active() const { return static_cast<bool>(group_); }
  // Whether the reduces launched from now on are a step's last (outside no_sync), whose owned
  // range is then replicated once finished.
  void set_last_micro_batch(bool last) { last_micro_batch_ = last; }

  // The core launched bucket b's reduce, and (later) finished it: its owned range holds the shard
  // group's sum. Finished, the all_reduces now due are launched, strictly in bucket order.
  void reduce_launched(int64_t bucket) { last_reduce_[bucket] = last_micro_batch_; }
  void reduce_finished(int64_t bucket);
  // At the step's end (every reduce finished): launch the ranges still due, whatever their size,
  // and wait for every all_reduce; the owned ranges then hold the sum over every rank.
  void finish_step();
  // A new step: nothing due, nothing pending, nothing counted.
  void new_step();
  // Payload bytes all_reduced over the replicas this step.
  int64_t bytes() const { return bytes_; }

 private:
  void launch_due();  // the all_reduces now due, in bucket order
  void launch(int64_t bucket);
  void flush();  // launch the pending ranges, whatever their size
  void all_reduce(std::vector<at::Tensor> ranges);

  const OwnedGrads* owned_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // null: no replicas
  bool coalesce_ = true;
  int64_t min_bytes_ = 0;
  bool last_micro_batch_ = false;
  std::vector<bool> last_reduce_;               // per bucket: its reduce in flight is the step's last
  std::vector<bool> due_;                       // per bucket: its last reduce is finished, this step
  int64_t next_ = 0;                            // buckets below this were all_reduced over the replicas
  int64_t pending_lo_ = 0, pending_numel_ = 0;  // owned ranges of grad_shard due, not launched yet
  std::vector<at::Tensor> pending_ranges_;      // persistent buckets: their owned ranges due, likewise
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  int64_t bytes_ = 0;
};

}  // namespace zerofast
