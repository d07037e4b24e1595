// See buckets.h. Each note sits beside the code it describes: [Note: comm stream] at OnCommStream,
// [Note: grads as bucket views] at buffer(), [Note: grads as views] at add_grad(),
// [Note: accumulation into the shard] at finish_reduce(), [Note: collectives per backend] at
// reduce(), [Note: two process groups] at gather_start(). The pool's notes ([Note: bucket pool],
// [Note: buffers in flight]) are in bucket_pool.cpp, the replicas' ([Note: replicas in backward])
// in replica_reducer.cpp.
#include "buckets.h"

#include <algorithm>

#include "errors.h"
#include "work_keeper.h"

#ifdef ZEROFAST_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace zerofast {

namespace {

// [Note: comm stream]
// On CUDA every collective is issued with a side stream (the "comm stream") current. Before a
// launch, an event recorded on the caller's stream (where backward copied the gradients into the
// bucket) is waited on by the comm stream, so the collective reads finished data; ProcessGroupNCCL
// orders its own stream after the current one, which is then the comm stream, so backward's
// compute is never blocked by communication. A bucket buffer used on the comm stream is never
// returned to the caching allocator: it goes back to the pool ([Note: bucket pool]) only after its
// collective has been waited for, so no record_stream is needed. When the reduces are waited for,
// the caller's stream waits on an event recorded on the comm stream, so the optimizer step reads
// the reduced gradients. Gathers follow the same pattern. On CPU (gloo) the Work handles alone
// order everything: gloo runs collectives on their own threads and Work::wait() returns when the
// data is in place.

// Makes the comm stream current for the scope, where there is one ([Note: comm stream]); on CPU
// (gloo) it does nothing, since the Work handles alone order everything.
class OnCommStream {
 public:
  explicit OnCommStream(const BucketComm::CommStream& stream) {
#ifdef ZEROFAST_WITH_CUDA
    if (stream) guard_.emplace(*stream);
#else
    (void)stream;
#endif
  }

 private:
#ifdef ZEROFAST_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
};

// A running hash of bucket indices in order, modulo the prime 2^61 - 1 (it fits an int64, negated
// too, for the agreement's MAX).
uint64_t mix(uint64_t h, int64_t bucket) {
  const unsigned __int128 x = static_cast<unsigned __int128>(h) * 1000003u + static_cast<uint64_t>(bucket) + 1u;
  return static_cast<uint64_t>(x % ((static_cast<uint64_t>(1) << 61) - 1));
}

bool valid_ops(bool flat, Collective reduce_op, Collective gather_op) {
  if (!flat) return reduce_op == Collective::kReduce && gather_op == Collective::kBroadcast;
  return (reduce_op == Collective::kAllReduce || reduce_op == Collective::kReduceScatter) &&
         (gather_op == Collective::kAllGather || gather_op == Collective::kBroadcast);
}

c10::intrusive_ptr<c10d::ProcessGroup> required_group(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  TORCH_CHECK(group, "BucketComm: options.group is needed (the process group that reduces)");
  return group;
}

BucketLayout checked(BucketLayout layout, int64_t world) {
  layout.check(world);
  return layout;
}

}  // namespace

void StepTraffic::count_reduce(int64_t bucket, int64_t bytes) {
  reduce_bytes_ += bytes;
  reduce_hash_ = mix(reduce_hash_, bucket);
}

void StepTraffic::count_gather(int64_t bucket, int64_t bytes) {
  gather_bytes_ += bytes;
  gather_hash_ = mix(gather_hash_, bucket);
}

BucketComm::BucketComm(BucketCommOptions options)
    : group_(required_group(std::move(options.group))),
      gather_group_(options.gather_group ? std::move(options.gather_group) : group_),
      rank_(group_->getRank()),
      world_(group_->getSize()),
      layout_(checked(std::move(options.layout), world_)),
      reduce_op_(options.reduce_op),
      gather_op_(options.gather_op),
      owned_(layout_, rank_, std::move(options.grad_shard), std::move(options.grad_buckets)),
      pool_(owned_.shard().options(), options.max_buffers),
      replicas_(owned_, layout_.num_buckets()),
      buffers_(layout_.num_buckets()),
      scatter_out_(layout_.num_buckets()),
      accumulate_(layout_.num_buckets(), false),
      gathers_(layout_.num_buckets()) {
  TORCH_CHECK(gather_group_->getSize() == world_ && gather_group_->getRank() == rank_,
              "BucketComm: gather_group must hold the same ranks as group");
  TORCH_CHECK(valid_ops(layout_.flat, reduce_op_, gather_op_), "BucketComm: reduce_op ", static_cast<int>(reduce_op_),
              " and gather_op ", static_cast<int>(gather_op_), " do not fit a ", layout_.flat ? "flat" : "owner",
              " layout (flat: all_reduce or reduce_scatter in, all_gather or broadcast out; owners: reduce "
              "and broadcast)");
#ifdef ZEROFAST_WITH_CUDA
  if (owned_.shard().is_cuda()) {
    comm_stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, owned_.shard().device().index());
  }
#endif
}

void BucketComm::check_bucket(int64_t bucket, const char* what) const {
  TORCH_CHECK(bucket >= 0 && bucket < layout_.num_buckets(), "BucketComm.", what, ": bucket must be in [0, ",
              layout_.num_buckets(), "); got ", bucket);
}

// [Note: grads as bucket views]
// Stage 1 keeps the full gradient anyway, so there the buckets are persistent (grad_buckets) and
// every parameter's .grad is a view of its slot, as DDP's gradient_as_bucket_view: autograd
// accumulates into the bucket, the reduce runs in place, and Adam reads its owned range where the
// reduce left it. No second gradient copy exists (before: .grad, a bucket buffer in flight, and a
// reduced shard); a rank holds the ZeRO paper's stage-1 row, parameters + gradients + 1/N of Adam.
// The gradient path (csrc/grad_path.cpp) re-points .grad at its view when autograd handed over a
// fresh tensor or user code replaced it (zero_grad with set_to_none, or an assignment), copying
// the values over.

at::Tensor& BucketComm::buffer(int64_t bucket) {
  auto& slot = buffers_[bucket];
  if (slot.has_value()) return *slot;
  if (owned_.persistent()) {  // see [Note: grads as bucket views]
    slot = owned_.persistent_bucket(bucket);
    return *slot;
  }
  // See [Note: buffers in flight] (bucket_pool.cpp): wait for the oldest reduces until the budget
  // has room; the pool counts a buffer taken without room.
  while (pool_.at_budget() && !in_flight_.empty()) finish_buckets({in_flight_.front().first});
  const int64_t numel = layout_.bucket_numels[bucket];
  slot = pool_.take(numel);
  // Padding (flat layout) is never written by a gradient: keep it zero. See [Note: padding].
  const int64_t used = layout_.used_numels[bucket];
  if (used < numel) slot->narrow(0, used, numel - used).zero_();
  return *slot;
}

void BucketComm::release(int64_t bucket) {
  auto& buf = buffers_[bucket];
  if (!owned_.persistent()) pool_.give_back(std::move(*buf));  // persistent: it stays, holding the reduced gradients
  buf.reset();
}

void BucketComm::finish_in_flight(int64_t bucket) {
  const bool busy =
      std::any_of(in_flight_.begin(), in_flight_.end(), [&](const auto& entry) { return entry.first == bucket; });
  if (busy) finish_buckets({bucket});
}

// [Note: grads as views]
// Stages 2 and 3 copy each gradient into the bucket (one memcpy per parameter) rather than keeping
// it as a view into it, as DDP's gradient_as_bucket_view does. With views, AccumulateGrad would
// write into the bucket directly, but the bucket would have to outlive the step, which is the full
// gradient that stage 2 exists not to keep, or the parameter's .grad would dangle (stage 2 frees
// buckets as soon as they are reduced). The copy costs one read and one write of each gradient,
// overlapped with the rest of backward.

void BucketComm::add_grad(int64_t bucket, int64_t offset, const at::Tensor& grad) {
  check_bucket(bucket, "add_grad");
  finish_in_flight(bucket);  // see [Note: accumulation into the shard]
  at::Tensor& buf = buffer(bucket);
  TORCH_CHECK(offset >= 0 && offset + grad.numel() <= buf.numel(), "BucketComm.add_grad: ", grad.numel(),
              " elements at offset ", offset, " do not fit in bucket ", bucket, " of ", buf.numel());
  // The gradient path checked the gradient against its parameter (GradientError); this guards the engine.
  TORCH_CHECK(grad.layout() == at::kStrided, "BucketComm.add_grad: a dense gradient is needed; got layout ",
              grad.layout());
  buf.narrow(0, offset, grad.numel()).view(grad.sizes()).copy_(grad);
}

void BucketComm::zero_slot(int64_t bucket, int64_t offset, int64_t numel) {
  check_bucket(bucket, "zero_slot");
  finish_in_flight(bucket);
  buffer(bucket).narrow(0, offset, numel).zero_();
}

void BucketComm::begin_comm() {
#ifdef ZEROFAST_WITH_CUDA
  if (comm_stream_) {
    at::cuda::CUDAEvent ready;
    ready.record(at::cuda::getCurrentCUDAStream(owned_.shard().device().index()));
    ready.block(*comm_stream_);
  }
#endif
}

void BucketComm::end_comm() {
#ifdef ZEROFAST_WITH_CUDA
  if (comm_stream_) {
    at::cuda::CUDAEvent done;
    done.record(*comm_stream_);
    done.block(at::cuda::getCurrentCUDAStream(owned_.shard().device().index()));
  }
#endif
}

void BucketComm::reap_completed() {
  // Stage 2 promises "its own gradient slice plus the buckets in flight": a bucket whose reduce is
  // done is copied out and released now, not at step().
  std::vector<int64_t> done;
  for (auto& entry : in_flight_) {
    const bool all_finished = std::all_of(in_flight_.begin(), in_flight_.end(), [&](const auto& other) {
      return other.first != entry.first || comm_call([&] { return other.second->isCompleted(); });
    });
    if (all_finished && std::find(done.begin(), done.end(), entry.first) == done.end()) done.push_back(entry.first);
  }
  if (!done.empty()) finish_buckets(done);
}

void BucketComm::finish_buckets(const std::vector<int64_t>& buckets) {
  auto listed = [&](int64_t bucket) { return std::find(buckets.begin(), buckets.end(), bucket) != buckets.end(); };
  std::vector<std::pair<int64_t, c10::intrusive_ptr<c10d::Work>>> still;
  {
    OnCommStream on_comm(comm_stream_);
    for (auto& entry : in_flight_) {
      if (listed(entry.first)) {
        comm_call([&] { return entry.second->wait(); });
      } else {
        still.push_back(entry);
      }
    }
    for (int64_t bucket : buckets) finish_reduce(bucket);  // on the comm stream, the replicas' launches too
  }
  in_flight_ = std::move(still);
  release_kept_works();  // the Works just waited for, if their backend has let go: [Note: clean exit]
  // finish_reduce read the buffers on the comm stream and returned them to the pool; the next
  // add_grad writes a pooled buffer on the caller's stream, which must wait for those reads.
  end_comm();
}

// [Note: accumulation into the shard]
// Gradient accumulation in stages 2 and 3 reduces every micro-batch (as DeepSpeed does): the first
// reduce of a bucket in a step overwrites the owned range of grad_shard, later ones add into it.
// reduce_scatter cannot add, so an accumulating one writes into a scratch slice that
// finish_reduce adds; all_reduce and reduce already leave the result in the bucket buffer, from
// which finish_reduce copies or adds. The next micro-batch's backward may want a bucket whose
// reduce is still in flight: add_grad and zero_slot finish that reduce first, so communication
// still overlaps the next micro-batch's forward and the early part of its backward.

void BucketComm::finish_reduce(int64_t bucket) {
  auto& buf = buffers_[bucket];
  if (!buf.has_value()) return;
  if (!owned_.persistent()) {  // persistent: reduced in place, the owned range is read where it is
    if (reduce_op_ != Collective::kReduceScatter) {  // the own reduced segment, from the bucket into the shard
      at::Tensor own = buf->narrow(0, owned_.start(bucket), owned_.numel(bucket));
      if (accumulate_[bucket]) {
        owned_.range(bucket).add_(own);
      } else {
        owned_.range(bucket).copy_(own);
      }
    } else if (scatter_out_[bucket].has_value()) {  // an accumulating reduce_scatter
      owned_.range(bucket).add_(*scatter_out_[bucket]);
      pool_.drop_scratch(*scatter_out_[bucket]);
      scatter_out_[bucket].reset();
    }
  }
  release(bucket);
  replicas_.reduce_finished(bucket);  // its owned range holds the shard group's sum: [Note: replicas in backward]
}

void BucketComm::new_step() {
  traffic_.reset();
  replicas_.new_step();
}

// [Note: collectives per backend]
// A flat layout needs "every rank ends with the sum of its slice" in and "every rank ends with
// every slice" out. On NCCL those are reduce_scatter and all_gather, the ring-optimal pair. gloo's
// own implementations of the two are slower than other collectives with the same result, measured
// on 2 CPU ranks (gloo over loopback) for a 25.6 MB bucket: reduce_scatter 34 ms against
// all_reduce 21 ms (then keep the own slice), and all_gather 19-26 ms against one broadcast per
// rank's slice 8 ms. So on gloo the flat layout reduces with all_reduce and gathers with
// broadcasts (zerofast/comm.py chooses); the numbers are the same, only the wire protocol differs.
// Re-measured for stage 3's unit-sized gathers (3 MB, 2 ranks, CPU per rank and wall per gather,
// several runs on a loaded 2-core machine): two broadcasts 0.60-0.89 ms CPU, 0.85-1.75 ms; all_gather
// 0.79-1.47 ms CPU, 1.83-2.61 ms. Broadcasts stay. (For the reduce, at 3 MB: all_reduce
// 1.15-2.01 ms CPU, one reduce per owner 0.86-1.60, point-to-point send/recv of each owner's slice
// 0.62-0.78; not adopted: gloo's send/recv Work cannot be polled, which reap_completed() needs.)

void BucketComm::reduce(int64_t bucket, bool accumulate) {
  check_bucket(bucket, "reduce");
  reap_completed();
  TORCH_CHECK(std::none_of(in_flight_.begin(), in_flight_.end(), [&](const auto& e) { return e.first == bucket; }),
              "BucketComm.reduce: bucket ", bucket, " is already being reduced");
  TORCH_CHECK(!(accumulate && owned_.persistent()), "BucketComm.reduce: persistent buckets (stage 1) are ",
              "reduced once per step; accumulate must be false");
  accumulate_[bucket] = accumulate;
  replicas_.reduce_launched(bucket);        // see [Note: replicas in backward]
  if (owned_.persistent()) buffer(bucket);  // the gradients are already there, as .grad views
  TORCH_CHECK(buffers_[bucket].has_value(), "BucketComm.reduce: bucket ", bucket, " has no gradients");
  at::Tensor buf = *buffers_[bucket];
  traffic_.count_reduce(bucket, layout_.bucket_numels[bucket] * buf.element_size());
  begin_comm();
  OnCommStream on_comm(comm_stream_);
  const auto& bd = layout_.bounds[bucket];
  if (reduce_op_ == Collective::kAllReduce) {
    std::vector<at::Tensor> whole{buf};
    in_flight_.emplace_back(bucket, issue([&] { return group_->allreduce(whole, c10d::AllreduceOptions()); }));
    return;
  }
  if (reduce_op_ == Collective::kReduceScatter) {
    at::Tensor out = owned_.range(bucket);  // persistent buckets: in place, at rank * slice, as NCCL allows
    if (accumulate) {                       // see [Note: accumulation into the shard]
      scatter_out_[bucket] = pool_.scratch_like(out);
      out = *scatter_out_[bucket];
    }
    in_flight_.emplace_back(
        bucket, issue([&] { return group_->_reduce_scatter_base(out, buf, c10d::ReduceScatterOptions()); }));
    return;
  }
  for (int64_t r = 0; r < world_; ++r) {
    if (bd[r + 1] == bd[r]) continue;  // this owner has nothing in the bucket
    std::vector<at::Tensor> segment{buf.narrow(0, bd[r], bd[r + 1] - bd[r])};
    c10d::ReduceOptions opts;
    opts.rootRank = r;
    in_flight_.emplace_back(bucket, issue([&] { return group_->reduce(segment, opts); }));
  }
}

void BucketComm::wait_reduces() {
  std::vector<int64_t> buckets;
  for (const auto& entry : in_flight_) {
    if (std::find(buckets.begin(), buckets.end(), entry.first) == buckets.end()) buckets.push_back(entry.first);
  }
  finish_buckets(buckets);
  if (!replicas_.active()) return;
  {  // see [Note: replicas in backward]
    OnCommStream on_comm(comm_stream_);
    replicas_.finish_step();
  }
  end_comm();
}

// [Note: two process groups]
// Collectives pair up across ranks by their order within a process group. Reduces are issued in
// bucket order, but when a bucket fills depends on the rank (a parameter with a gradient on only
// some ranks fills it there during backward, elsewhere only at step()), while stage 3's gathers are
// issued as modules run. On one group, rank A could issue [gather u, reduce b] and rank B
// [reduce b, gather u]: a hang, or worse, mixed data. So stage 3 gathers on a second group with
// the same ranks; each group's own order is then the same everywhere.

void BucketComm::gather_start(int64_t bucket, const at::Tensor& param_buffer) {
  check_bucket(bucket, "gather_start");
  TORCH_CHECK(gathers_[bucket].empty(), "BucketComm.gather_start: bucket ", bucket, " is already being gathered");
  const int64_t numel = layout_.bucket_numels[bucket];
  TORCH_CHECK(param_buffer.dim() == 1 && param_buffer.numel() == numel, "BucketComm.gather_start: bucket ", bucket,
              " needs a flat buffer of ", numel, " elements; got shape ", param_buffer.sizes());
  traffic_.count_gather(bucket, param_buffer.numel() * param_buffer.element_size());
  begin_comm();
  OnCommStream on_comm(comm_stream_);
  at::Tensor out = param_buffer;
  const auto& bd = layout_.bounds[bucket];
  if (gather_op_ == Collective::kAllGather) {
    at::Tensor mine = out.narrow(0, bd[rank_], bd[rank_ + 1] - bd[rank_]);
    gathers_[bucket].push_back(
        issue([&] { return gather_group_->_allgather_base(out, mine, c10d::AllgatherOptions()); }));
    return;
  }
  for (int64_t r = 0; r < world_; ++r) {
    if (bd[r + 1] == bd[r]) continue;
    std::vector<at::Tensor> segment{out.narrow(0, bd[r], bd[r + 1] - bd[r])};
    c10d::BroadcastOptions opts;
    opts.rootRank = r;
    gathers_[bucket].push_back(issue([&] { return gather_group_->broadcast(segment, opts); }));
  }
}

void BucketComm::gather_wait(int64_t bucket) {
  check_bucket(bucket, "gather_wait");
  {
    OnCommStream on_comm(comm_stream_);
    for (auto& work : gathers_[bucket]) comm_call([&] { return work->wait(); });
  }
  gathers_[bucket].clear();
  release_kept_works();  // see [Note: clean exit] in work_keeper.cpp
  end_comm();
}

}  // namespace zerofast
