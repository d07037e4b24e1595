// The reduce/gather core: flat gradient buckets and the collectives that reduce them and gather
// parameters, issued through the c10d ProcessGroup handed over from Python. Python decides the
// layout (zerofast/layout.py); the gradient path (grad_path.h) decides when each bucket's reduce is
// launched, and stage 3's hooks and the parameter gather (Python) when gathers are. BucketComm owns
// the copies, the Work handles in flight, the step's counters and, on CUDA, the side stream and its
// events; its parts own the rest: the buffers (BucketPool, bucket_pool.h) and hybrid sharding's
// all_reduce over the replicas (ReplicaReducer, replica_reducer.h). A failure of a c10d call
// (issuing a collective, or waiting for one) is thrown as CommError (errors.h); its own checks are
// TORCH_CHECKs.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <utility>
#include <vector>

#include "bucket_layout.h"
#include "bucket_pool.h"
#include "replica_reducer.h"

#ifdef ZEROFAST_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace zerofast {

// The collective a bucket is reduced or gathered with. zerofast/comm.py chooses per backend and
// layout (its one home: [Note: collectives per backend]); the flat layout takes kAllReduce or
// kReduceScatter in and kBroadcast or kAllGather out, owner layouts kReduce in and kBroadcast out.
enum class Collective { kAllReduce, kReduceScatter, kReduce, kAllGather, kBroadcast };

// What a BucketComm is built from, by name.
struct BucketCommOptions {
  // group reduces; gather_group gathers (null: group, as for stages 1 and 2; stage 3 passes a
  // second group of the same ranks: see [Note: two process groups]).
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::ProcessGroup> gather_group;
  BucketLayout layout;
  // The collectives this layout uses (see Collective above).
  Collective reduce_op = Collective::kAllReduce;
  Collective gather_op = Collective::kBroadcast;
  // grad_shard: this rank's flat reduced-gradient shard (layout.shard_offsets say where each
  // bucket's owned range starts in it). Its dtype is the reduce dtype; so is every bucket buffer.
  at::Tensor grad_shard;
  // Empty, or one flat tensor per bucket that *is* the bucket for good (stage 1: the parameters'
  // .grad are views of them; [Note: grads as bucket views]): reduced in place, never released, and
  // the owned range of each is read where the reduce left it (grad_shard is then empty). Otherwise
  // buffers are taken from the pool while in use.
  std::vector<at::Tensor> grad_buckets;
  // At most this many pooled bucket buffers alive at once, in use or kept for reuse (0: no bound);
  // see [Note: buffers in flight].
  int64_t max_buffers = 0;
};

// This step's traffic, counted where the collectives are issued (the C++ gradient path launches
// reduces without Python): payload bytes, and running hashes of the buckets reduced and gathered
// in order, which the step's agreement compares across ranks ([Note: the step's agreement] in
// zerofast/optim/grads.py). The replicas' bytes are ReplicaReducer::bytes().
class StepTraffic {
 public:
  void count_reduce(int64_t bucket, int64_t bytes);
  void count_gather(int64_t bucket, int64_t bytes);
  void reset() { *this = StepTraffic(); }
  int64_t reduce_bytes() const { return reduce_bytes_; }
  int64_t gather_bytes() const { return gather_bytes_; }
  int64_t reduce_hash() const { return static_cast<int64_t>(reduce_hash_); }
  int64_t gather_hash() const { return static_cast<int64_t>(gather_hash_); }

 private:
  int64_t reduce_bytes_ = 0;
  int64_t gather_bytes_ = 0;
  uint64_t reduce_hash_ = 0;
  uint64_t gather_hash_ = 0;
};

class BucketComm {
 public:
  explicit BucketComm(BucketCommOptions options);
  // Its parts point at its own members: never copied or moved.
  BucketComm(const BucketComm&) = delete;
  BucketComm& operator=(const BucketComm&) = delete;

  // Copy one parameter's gradient into its slot (taking the bucket's buffer on first use).
  void add_grad(int64_t bucket, int64_t offset, const at::Tensor& grad);
  // Zero a slot whose parameter got no gradient on this rank (it then counts as zero).
  void zero_slot(int64_t bucket, int64_t offset, int64_t numel);
  // Start reducing a bucket (asynchronously); the buffer is released once it has been waited for.
  // accumulate: add the reduced owned range into grad_shard instead of overwriting it (the second
  // and later micro-batches of an accumulated step: see [Note: accumulation into the shard]).
  // A bucket whose previous reduce is still in flight is finished before it is written again.
  void reduce(int64_t bucket, bool accumulate);
  // Wait for every reduce in flight (and, with replicas, every all_reduce over them); afterwards
  // grad_shard holds the summed owned gradients.
  void wait_reduces();
  // Start gathering bucket b's updated parameters into param_buffer (its flat parameter buffer,
  // whose owned range each rank has updated); gather_wait(b) returns when it is in place.
  void gather_start(int64_t bucket, const at::Tensor& param_buffer);
  void gather_wait(int64_t bucket);
  // A new step: its traffic counted from zero, nothing due to the replicas.
  void new_step();

  // The parts: the buffers and their counts; hybrid sharding's replicas ([Note: replicas in
  // backward]), whose group is set once after construction; this step's traffic.
  BucketPool& pool() { return pool_; }
  const BucketPool& pool() const { return pool_; }
  ReplicaReducer& replicas() { return replicas_; }
  const StepTraffic& traffic() const { return traffic_; }

  // The side stream collectives run on (CUDA builds with CUDA tensors); nothing on CPU builds.
#ifdef ZEROFAST_WITH_CUDA
  using CommStream = std::optional<c10::cuda::CUDAStream>;
#else
  struct CommStream {};
#endif

 private:
  at::Tensor& buffer(int64_t bucket);
  void release(int64_t bucket);
  void reap_completed();                                     // finish the reduces that are done (see reduce())
  void finish_reduce(int64_t bucket);                        // copy (or add) the own segment out, release the buffer
  void finish_in_flight(int64_t bucket);                     // wait for and finish this bucket's reduce, if in flight
  void finish_buckets(const std::vector<int64_t>& buckets);  // wait for, finish and forget their reduces
  void check_bucket(int64_t bucket, const char* what) const;
  void begin_comm();  // on CUDA: order the comm stream after the work queued so far
  void end_comm();    // on CUDA: order the current stream after the comm stream

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::intrusive_ptr<c10d::ProcessGroup> gather_group_;
  int64_t rank_;
  int64_t world_;
  BucketLayout layout_;
  Collective reduce_op_;  // kAllReduce: all_reduce the bucket, keep the own slice
  Collective gather_op_;  // kBroadcast: broadcast each rank's slice from that rank
  OwnedGrads owned_;      // where each reduced owned range lands
  BucketPool pool_;
  ReplicaReducer replicas_;  // reads owned_
  StepTraffic traffic_;
  std::vector<std::optional<at::Tensor>> buffers_;      // per bucket, alive while in use
  std::vector<std::optional<at::Tensor>> scatter_out_;  // per bucket: reduce_scatter output to add
  std::vector<bool> accumulate_;                        // per bucket: add into grad_shard
  std::vector<std::pair<int64_t, c10::intrusive_ptr<c10d::Work>>> in_flight_;  // reduces: (bucket, work)
  std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> gathers_;           // per bucket, in flight
  CommStream comm_stream_;
};

}  // namespace zerofast
