// Flat gradient buckets and the collectives that reduce them and gather parameters, issued through
// the c10d ProcessGroup handed over from Python. Python decides the layout (zerofast/layout.py);
// the gradient path (grad_path.h) decides when each bucket's reduce is launched, and stage 3's
// hooks and the parameter gather (Python) when gathers are. This class owns the buffers, the
// copies, the Work handles and, on CUDA, the side stream and its events. A failure of a c10d call
// (issuing a collective, or waiting for one) is thrown as CommError (errors.h); its own checks are
// TORCH_CHECKs.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#ifdef ZEROFAST_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace zerofast {

// The collective a bucket is reduced or gathered with. zerofast/comm.py chooses per backend and
// layout (its one home: [Note: collectives per backend]); the flat layout takes kAllReduce or
// kReduceScatter in and kBroadcast or kAllGather out, owner layouts kReduce in and kBroadcast out.
enum class Collective { kAllReduce, kReduceScatter, kReduce, kAllGather, kBroadcast };

class BucketComm {
 public:
  // bucket_numels[b]: buffer length of bucket b (padding included); used_numels[b]: how many of
  //   those hold parameters (the rest is padding, kept zero).
  // bounds[b]: world + 1 offsets; rank r owns [bounds[b][r], bounds[b][r + 1]) of bucket b.
  // flat: every bucket's slices are equal (reduce_scatter / all_gather); else one reduce to and one
  //   broadcast from each owner's segment.
  // grad_shard: this rank's flat reduced-gradient shard; shard_offsets[b] is where bucket b's
  //   owned range starts in it. Its dtype is the reduce dtype; so is every bucket buffer.
  // reduce_op / gather_op: the collectives this layout uses (see Collective above).
  // group reduces; gather_group gathers (the same group for stages 1 and 2; stage 3 passes a second
  //   one: see [Note: two process groups]).
  // grad_buckets: empty, or one flat tensor per bucket that *is* the bucket for good (stage 1: the
  //   parameters' .grad are views of them; [Note: grads as bucket views]): reduced in place, never
  //   released, and the owned range of each is read where the reduce left it (grad_shard is then
  //   empty). Otherwise buffers are taken from a pool while in use.
  // max_buffers: at most this many pooled bucket buffers alive at once, in use or kept for reuse
  //   (0: no bound); see [Note: buffers in flight].
  BucketComm(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::intrusive_ptr<c10d::ProcessGroup> gather_group,
             std::vector<int64_t> bucket_numels, std::vector<int64_t> used_numels,
             std::vector<std::vector<int64_t>> bounds, bool flat, at::Tensor grad_shard,
             std::vector<int64_t> shard_offsets, Collective reduce_op, Collective gather_op,
             std::vector<at::Tensor> grad_buckets, int64_t max_buffers);

  // Copy one parameter's gradient into its slot (allocating the bucket's buffer on first use).
  void add_grad(int64_t bucket, int64_t offset, const at::Tensor& grad);
  // Zero a slot whose parameter got no gradient on this rank (it then counts as zero).
  void zero_slot(int64_t bucket, int64_t offset, int64_t numel);
  // Start reducing a bucket (asynchronously); the buffer is released once it has been waited for.
  // accumulate: add the reduced owned range into grad_shard instead of overwriting it (the second
  // and later micro-batches of an accumulated step: see [Note: accumulation into the shard]).
  // A bucket whose previous reduce is still in flight is finished before it is written again.
  void reduce(int64_t bucket, bool accumulate);
  // Wait for every reduce in flight (and, with replicas, every replicate all_reduce); afterwards
  // grad_shard holds the summed owned gradients.
  void wait_reduces();
  // Hybrid sharding ([Note: replicas in backward]): the group of the ranks holding this rank's shard
  // in the other shard groups. Each owned range is all_reduced over it once per step, after its
  // bucket's last reduce of the step, in bucket order. set_replicate(true): the reduces launched from
  // now on are a step's last (outside no_sync), so their owned range is replicated when finished.
  // min_bytes: consecutive owned ranges are all_reduced together until they hold at least this.
  void set_replicate_group(c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t min_bytes);
  void set_replicate(bool on) { replicate_on_launch_ = on; }
  // Start gathering bucket b's updated parameters into param_buffer (its flat parameter buffer,
  // whose owned range each rank has updated); gather_wait(b) returns when it is in place.
  void gather_start(int64_t bucket, const at::Tensor& param_buffer);
  void gather_wait(int64_t bucket);
  // Bytes of gradient bucket buffers in use now, the most in use at once since construction, and
  // those kept for reuse (never more than that peak). Persistent grad_buckets are not counted here:
  // they are the gradients.
  int64_t buffer_bytes() const { return buffer_bytes_; }
  int64_t peak_buffer_bytes() const { return peak_buffer_bytes_; }
  int64_t pooled_bytes() const;
  // Counts of pooled buffers: in use now (being filled or being reduced), the most in use at once
  // since the last reset_peak(), the most alive at once (in use + kept) since then, and how often
  // a buffer was needed beyond max_buffers with no reduce in flight to wait for (buckets filled
  // out of order: see [Note: buffers in flight]).
  int64_t live_buffers() const { return live_; }
  int64_t peak_live_buffers() const { return peak_live_; }
  int64_t peak_alive_buffers() const { return peak_alive_; }
  int64_t over_budget() const { return over_budget_; }
  void reset_peak() {
    peak_live_ = live_;
    peak_alive_ = live_ + static_cast<int64_t>(pool_.size());
  }
  int64_t max_buffers() const { return max_buffers_; }
  // This step's traffic, counted where the collectives are issued (the C++ gradient path launches
  // reduces without Python): payload bytes, and running hashes of the buckets reduced and gathered
  // in order, which the step's agreement compares across ranks ([Note: the step's agreement] in
  // zerofast/optim/grads.py). reset_counts() at each new step.
  int64_t reduce_bytes() const { return reduce_bytes_; }
  int64_t gather_bytes() const { return gather_bytes_; }
  int64_t replicate_bytes() const { return replicate_bytes_; }
  int64_t reduce_hash() const { return static_cast<int64_t>(reduce_hash_); }
  int64_t gather_hash() const { return static_cast<int64_t>(gather_hash_); }
  void reset_counts();

  // The side stream collectives run on (CUDA builds with CUDA tensors); nothing on CPU builds.
#ifdef ZEROFAST_WITH_CUDA
  using CommStream = std::optional<c10::cuda::CUDAStream>;
#else
  struct CommStream {};
#endif

 private:
  at::Tensor& buffer(int64_t bucket);
  at::Tensor take_buffer(int64_t numel);  // from the pool, or new, within max_buffers
  void release(int64_t bucket);
  void note_alive();
  void reap_completed();                                     // finish the reduces that are done (see reduce())
  void finish_reduce(int64_t bucket);                        // copy (or add) the own segment out, release the buffer
  void finish_in_flight(int64_t bucket);                     // wait for and finish this bucket's reduce, if in flight
  void finish_buckets(const std::vector<int64_t>& buckets);  // wait for, finish and forget their reduces
  void check_bucket(int64_t bucket, const char* what) const;
  void replicate_ready();  // launch the replicate all_reduces now due, in bucket order
  void launch_replicate(int64_t bucket);
  void flush_replicate();  // launch the pending ranges, whatever their size
  void all_reduce_replicas(std::vector<at::Tensor> ranges);
  at::Tensor owned_grad(int64_t bucket);
  void begin_comm();  // on CUDA: order the comm stream after the work queued so far
  void end_comm();    // on CUDA: order the current stream after the comm stream

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::intrusive_ptr<c10d::ProcessGroup> gather_group_;
  int64_t rank_;
  int64_t world_;
  std::vector<int64_t> bucket_numels_;
  std::vector<int64_t> used_numels_;
  std::vector<std::vector<int64_t>> bounds_;
  bool flat_;
  Collective reduce_op_;  // kAllReduce: all_reduce the bucket, keep the own slice
  Collective gather_op_;  // kBroadcast: broadcast each rank's slice from that rank
  at::Tensor grad_shard_;
  std::vector<int64_t> shard_offsets_;
  std::vector<std::optional<at::Tensor>> buffers_;      // per bucket, alive while in use
  std::vector<std::optional<at::Tensor>> scatter_out_;  // per bucket: reduce_scatter output to add
  std::vector<bool> accumulate_;                        // per bucket: add into grad_shard
  std::vector<at::Tensor> pool_;                        // released buffers, for reuse
  std::vector<std::pair<int64_t, c10::intrusive_ptr<c10d::Work>>> in_flight_;  // reduces: (bucket, work)
  std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> gathers_;           // per bucket, in flight
  std::vector<at::Tensor> grad_buckets_;                                       // persistent buckets (stage 1), or empty
  int64_t max_buffers_;
  int64_t buffer_bytes_ = 0;
  int64_t peak_buffer_bytes_ = 0;
  int64_t live_ = 0;
  int64_t peak_live_ = 0;
  int64_t peak_alive_ = 0;
  int64_t over_budget_ = 0;
  int64_t reduce_bytes_ = 0;
  int64_t gather_bytes_ = 0;
  uint64_t reduce_hash_ = 0;
  uint64_t gather_hash_ = 0;
  // Hybrid sharding: [Note: replicas in backward].
  c10::intrusive_ptr<c10d::ProcessGroup> replicate_group_;  // null: no replicas
  bool replicate_on_launch_ = false;
  std::vector<bool> last_reduce_;    // per bucket: its reduce in flight is the step's last
  std::vector<bool> replicate_due_;  // per bucket: its last reduce is finished, this step
  int64_t next_replicate_ = 0;       // buckets below this were all_reduced over the replicas
  int64_t replicate_min_bytes_ = 0;
  int64_t pending_lo_ = 0, pending_numel_ = 0;  // owned ranges of grad_shard due, not launched yet
  std::vector<at::Tensor> pending_ranges_;      // stage 1: owned ranges of its buckets due, likewise
  std::vector<c10::intrusive_ptr<c10d::Work>> replicate_works_;
  int64_t replicate_bytes_ = 0;
  CommStream comm_stream_;
};

}  // namespace zerofast
