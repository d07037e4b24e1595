// See buckets.h. Each note sits beside the code it describes: [Note: comm stream] at OnCommStream,
// [Note: grads as bucket views] at buffer(), [Note: bucket pool] and [Note: buffers in flight] at
// take_buffer(), [Note: grads as views] at add_grad(), [Note: accumulation into the shard] at
// finish_reduce(), [Note: collectives per backend] at reduce(), [Note: two process groups] at
// gather_start().
#include "buckets.h"

#include <algorithm>

#include "errors.h"

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

}  // namespace

BucketComm::BucketComm(c10::intrusive_ptr<c10d::ProcessGroup> group,
                       c10::intrusive_ptr<c10d::ProcessGroup> gather_group, std::vector<int64_t> bucket_numels,
                       std::vector<int64_t> used_numels, std::vector<std::vector<int64_t>> bounds, bool flat,
                       at::Tensor grad_shard, std::vector<int64_t> shard_offsets, Collective reduce_op,
                       Collective gather_op, std::vector<at::Tensor> grad_buckets, int64_t max_buffers)
    : group_(std::move(group)),
      gather_group_(std::move(gather_group)),
      rank_(group_->getRank()),
      world_(group_->getSize()),
      bucket_numels_(std::move(bucket_numels)),
      used_numels_(std::move(used_numels)),
      bounds_(std::move(bounds)),
      flat_(flat),
      reduce_op_(reduce_op),
      gather_op_(gather_op),
      grad_shard_(std::move(grad_shard)),
      shard_offsets_(std::move(shard_offsets)),
      buffers_(bucket_numels_.size()),
      scatter_out_(bucket_numels_.size()),
      accumulate_(bucket_numels_.size(), false),
      gathers_(bucket_numels_.size()),
      grad_buckets_(std::move(grad_buckets)),
      max_buffers_(max_buffers),
      last_reduce_(bucket_numels_.size(), false),
      replicate_due_(bucket_numels_.size(), false) {
  TORCH_CHECK(max_buffers_ >= 0, "BucketComm: max_buffers must be 0 (no bound) or positive; got ", max_buffers_);
  TORCH_CHECK(grad_buckets_.empty() || grad_buckets_.size() == bucket_numels_.size(), "BucketComm: grad_buckets ",
              "needs one tensor per bucket (", bucket_numels_.size(), ") or none; got ", grad_buckets_.size());
  for (size_t b = 0; b < grad_buckets_.size(); ++b) {
    const auto& t = grad_buckets_[b];
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.numel() == bucket_numels_[b] &&
                    t.scalar_type() == grad_shard_.scalar_type() && t.device() == grad_shard_.device(),
                "BucketComm: grad_buckets[", b, "] must be a flat contiguous ", grad_shard_.scalar_type(),
                " tensor of ", bucket_numels_[b], " elements on ", grad_shard_.device(), "; got ", t.scalar_type(),
                " of shape ", t.sizes(), " on ", t.device());
  }
  TORCH_CHECK(bounds_.size() == bucket_numels_.size() && shard_offsets_.size() == bucket_numels_.size() &&
                  used_numels_.size() == bucket_numels_.size(),
              "BucketComm: used_numels (", used_numels_.size(), "), bounds (", bounds_.size(), ") and shard_offsets (",
              shard_offsets_.size(), ") need one entry per bucket (", bucket_numels_.size(), ")");
  TORCH_CHECK(gather_group_->getSize() == world_ && gather_group_->getRank() == rank_,
              "BucketComm: gather_group must hold the same ranks as group");
  TORCH_CHECK(valid_ops(flat_, reduce_op_, gather_op_), "BucketComm: reduce_op ", static_cast<int>(reduce_op_),
              " and gather_op ", static_cast<int>(gather_op_), " do not fit a ", flat_ ? "flat" : "owner",
              " layout (flat: all_reduce or reduce_scatter in, all_gather or broadcast out; owners: reduce "
              "and broadcast)");
  TORCH_CHECK(grad_shard_.dim() == 1 && grad_shard_.is_contiguous(),
              "BucketComm: grad_shard must be a flat contiguous tensor; got shape ", grad_shard_.sizes());
  for (size_t b = 0; b < bounds_.size(); ++b) {
    const auto& bd = bounds_[b];
    TORCH_CHECK(static_cast<int64_t>(bd.size()) == world_ + 1, "BucketComm: bucket ", b, " has ", bd.size(),
                " bounds for a world of ", world_);
    TORCH_CHECK(bd.front() == 0 && bd.back() == bucket_numels_[b], "BucketComm: bucket ", b,
                " bounds must run from 0 to its numel ", bucket_numels_[b]);
    TORCH_CHECK(!grad_buckets_.empty() || shard_offsets_[b] + bd[rank_ + 1] - bd[rank_] <= grad_shard_.numel(),
                "BucketComm: bucket ", b, "'s owned range does not fit in grad_shard (", grad_shard_.numel(),
                " elements)");
  }
#ifdef ZEROFAST_WITH_CUDA
  if (grad_shard_.is_cuda()) {
    comm_stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, grad_shard_.device().index());
  }
#endif
}

void BucketComm::check_bucket(int64_t bucket, const char* what) const {
  TORCH_CHECK(bucket >= 0 && bucket < static_cast<int64_t>(bucket_numels_.size()), "BucketComm.", what,
              ": bucket must be in [0, ", bucket_numels_.size(), "); got ", bucket);
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
  if (!slot.has_value()) {
    if (!grad_buckets_.empty()) {  // persistent: see [Note: grads as bucket views]
      slot = grad_buckets_[bucket];
      return *slot;
    }
    const int64_t numel = bucket_numels_[bucket];
    slot = take_buffer(numel);
    // Padding (flat layout) is never written by a gradient: keep it zero. See [Note: padding].
    const int64_t used = used_numels_[bucket];
    if (used < numel) slot->narrow(0, used, numel - used).zero_();
    buffer_bytes_ += numel * slot->element_size();
    peak_buffer_bytes_ = std::max(peak_buffer_bytes_, buffer_bytes_);
    ++live_;
    note_alive();
  }
  return *slot;
}

// [Note: bucket pool]
// A bucket's buffer is released after its reduce has been waited for, and kept in a pool for the
// next bucket of that size: allocating and first-touching 25 MB costs ~4 ms per step on CPU (page
// faults), which a training step would pay every time. What the pool keeps counts against the
// budget below.
//
// [Note: buffers in flight]
// Without a bound, the buffers alive at once are as many as backward runs ahead of the network:
// on a fast GPU or a slow link, nearly every bucket of the model (Φ bytes: stage 2 would then hold
// a full gradient after all). max_buffers bounds the pooled buffers alive at once, in use or kept
// for reuse, as FSDP2 bounds its collectives in flight: when a bucket needs a buffer and the budget
// is spent, the oldest reduce in flight is waited for and its buffer reused (or freed, when its
// size differs). With the default of 2, one buffer is being filled while the previous one is being
// reduced. The wait cannot hang: the reduce waited for was launched here, and every rank launches
// reduces in the same order. Only when no reduce is in flight (every live buffer is still being
// filled: a bucket whose gradients arrive out of backward order, as with a parameter used early and
// late) a buffer beyond the budget is allocated, and over_budget() counts it: waiting would hang.

at::Tensor BucketComm::take_buffer(int64_t numel) {
  // See [Note: buffers in flight]: wait for the oldest reduces until the budget has room.
  while (max_buffers_ > 0 && live_ >= max_buffers_ && !in_flight_.empty()) {
    finish_buckets({in_flight_.front().first});
  }
  if (max_buffers_ > 0 && live_ >= max_buffers_) ++over_budget_;  // nothing in flight to wait for
  auto pooled = std::find_if(pool_.begin(), pool_.end(), [&](const at::Tensor& t) { return t.numel() == numel; });
  if (pooled != pool_.end()) {  // see [Note: bucket pool]
    at::Tensor t = std::move(*pooled);
    pool_.erase(pooled);
    return t;
  }
  // A new buffer: make room by freeing kept ones of other sizes first.
  while (max_buffers_ > 0 && !pool_.empty() && live_ + static_cast<int64_t>(pool_.size()) >= max_buffers_) {
    pool_.erase(pool_.begin());
  }
  return at::empty({numel}, grad_shard_.options());
}

void BucketComm::note_alive() {
  peak_live_ = std::max(peak_live_, live_);
  peak_alive_ = std::max(peak_alive_, live_ + static_cast<int64_t>(pool_.size()));
}

void BucketComm::release(int64_t bucket) {
  auto& buf = buffers_[bucket];
  if (!grad_buckets_.empty()) {  // persistent: it stays, holding the reduced gradients
    buf.reset();
    return;
  }
  buffer_bytes_ -= buf->numel() * buf->element_size();
  --live_;
  pool_.push_back(std::move(*buf));
  buf.reset();
  // The pool keeps at most what the budget leaves ([Note: buffers in flight]).
  while (max_buffers_ > 0 && !pool_.empty() && live_ + static_cast<int64_t>(pool_.size()) > max_buffers_) {
    pool_.erase(pool_.begin());
  }
}

int64_t BucketComm::pooled_bytes() const {
  int64_t total = 0;
  for (const auto& t : pool_) total += t.numel() * t.element_size();
  return total;
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
    ready.record(at::cuda::getCurrentCUDAStream(grad_shard_.device().index()));
    ready.block(*comm_stream_);
  }
#endif
}

void BucketComm::end_comm() {
#ifdef ZEROFAST_WITH_CUDA
  if (comm_stream_) {
    at::cuda::CUDAEvent done;
    done.record(*comm_stream_);
    done.block(at::cuda::getCurrentCUDAStream(grad_shard_.device().index()));
  }
#endif
}

at::Tensor BucketComm::owned_grad(int64_t bucket) {
  const auto& bd = bounds_[bucket];
  if (!grad_buckets_.empty()) return grad_buckets_[bucket].narrow(0, bd[rank_], bd[rank_ + 1] - bd[rank_]);
  return grad_shard_.narrow(0, shard_offsets_[bucket], bd[rank_ + 1] - bd[rank_]);
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
    for (int64_t bucket : buckets) finish_reduce(bucket);
  }
  in_flight_ = std::move(still);
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
  const auto& bd = bounds_[bucket];
  if (replicate_group_ && last_reduce_[bucket]) {  // [Note: replicas in backward]
    replicate_due_[bucket] = true;
    last_reduce_[bucket] = false;
  }
  if (!grad_buckets_.empty()) {  // reduced in place: the owned range is read where it is
    release(bucket);
    replicate_ready();
    return;
  }
  if (reduce_op_ != Collective::kReduceScatter) {  // the own reduced segment, from the bucket into the shard
    at::Tensor own = buf->narrow(0, bd[rank_], bd[rank_ + 1] - bd[rank_]);
    if (accumulate_[bucket]) {
      owned_grad(bucket).add_(own);
    } else {
      owned_grad(bucket).copy_(own);
    }
  } else if (scatter_out_[bucket].has_value()) {  // an accumulating reduce_scatter
    owned_grad(bucket).add_(*scatter_out_[bucket]);
    buffer_bytes_ -= scatter_out_[bucket]->numel() * scatter_out_[bucket]->element_size();
    scatter_out_[bucket].reset();
  }
  release(bucket);
  replicate_ready();
}

// [Note: replicas in backward]
// Hybrid sharding ([Note: hybrid sharding] in zerofast/topology.py) sums each owned gradient range
// over the replicas once per step, after the range holds the shard group's sum of the step. Done
// in step() it would wait for the whole backward; here a bucket's range is all_reduced over the
// replicate group as soon as its last reduce of the step is finished (when backward needs its
// buffer, at the next launch's reap, or at wait_reduces), so it overlaps the rest of backward as
// the reduces do. "Last": launched after set_replicate(true), which Python sets outside no_sync(),
// so the micro-batches accumulating into the shard under no_sync() never cross machines. Replicas
// pair their all_reduces by order, and a reduce may finish out of order (gloo runs collectives on
// several threads), so they are launched strictly in bucket order: bucket b's waits for every
// bucket before it. Owned ranges are 1/K of a bucket, and a ring over many replicas pays its latency
// per call, so consecutive ranges (adjacent in grad_shard) go in one all_reduce until it holds
// min_bytes (the shard group's bucket size); stage 1's ranges sit in separate buckets, and go
// together as one coalesced all_reduce.
// wait_reduces launches whatever is left (the last ranges, a bucket whose last reduce was under
// no_sync), waits for all, and the step's agreement and Adam then read the replicated sum.
void BucketComm::set_replicate_group(c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t min_bytes) {
  TORCH_CHECK(group, "BucketComm.set_replicate_group: a process group is needed");
  TORCH_CHECK(min_bytes >= 0, "BucketComm.set_replicate_group: min_bytes must be >= 0; got ", min_bytes);
  replicate_group_ = std::move(group);
  replicate_min_bytes_ = min_bytes;
}

void BucketComm::replicate_ready() {
  while (next_replicate_ < static_cast<int64_t>(replicate_due_.size()) && replicate_due_[next_replicate_]) {
    launch_replicate(next_replicate_++);
  }
}

void BucketComm::launch_replicate(int64_t bucket) {
  const auto& bd = bounds_[bucket];
  const int64_t numel = bd[rank_ + 1] - bd[rank_];
  if (numel == 0) return;        // the same on every replica: they hold the same shard
  if (!grad_buckets_.empty()) {  // stage 1: this bucket's owned range, where the reduce left it
    pending_ranges_.push_back(owned_grad(bucket));
  } else {  // grad_shard: the pending ranges and this one are adjacent (bucket order)
    if (pending_numel_ == 0) pending_lo_ = shard_offsets_[bucket];
  }
  pending_numel_ += numel;
  if (pending_numel_ * grad_shard_.element_size() >= replicate_min_bytes_) flush_replicate();
}

void BucketComm::flush_replicate() {
  if (pending_numel_ == 0) return;
  std::vector<at::Tensor> ranges = grad_buckets_.empty()
                                       ? std::vector<at::Tensor>{grad_shard_.narrow(0, pending_lo_, pending_numel_)}
                                       : std::move(pending_ranges_);
  pending_ranges_.clear();
  pending_numel_ = 0;
  all_reduce_replicas(std::move(ranges));
}

void BucketComm::all_reduce_replicas(std::vector<at::Tensor> ranges) {
  for (const auto& r : ranges) replicate_bytes_ += r.numel() * r.element_size();
  if (ranges.size() == 1) {
    replicate_works_.push_back(
        comm_call([&] { return replicate_group_->allreduce(ranges, c10d::AllreduceOptions()); }));
  } else {
    replicate_works_.push_back(
        comm_call([&] { return replicate_group_->allreduce_coalesced(ranges, c10d::AllreduceCoalescedOptions()); }));
  }
}

void BucketComm::reset_counts() {
  reduce_bytes_ = gather_bytes_ = replicate_bytes_ = 0;
  reduce_hash_ = gather_hash_ = 0;
  std::fill(replicate_due_.begin(), replicate_due_.end(), false);
  next_replicate_ = 0;
  pending_numel_ = 0;
  pending_ranges_.clear();
  // Nothing is in flight at a new step, unless the last one ended in an error before wait_reduces:
  // its launches are not this step's.
  std::fill(last_reduce_.begin(), last_reduce_.end(), false);
  replicate_works_.clear();
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
  TORCH_CHECK(!(accumulate && !grad_buckets_.empty()), "BucketComm.reduce: persistent buckets (stage 1) are ",
              "reduced once per step; accumulate must be false");
  accumulate_[bucket] = accumulate;
  last_reduce_[bucket] = replicate_on_launch_;  // see [Note: replicas in backward]
  if (!grad_buckets_.empty()) buffer(bucket);   // the gradients are already there, as .grad views
  TORCH_CHECK(buffers_[bucket].has_value(), "BucketComm.reduce: bucket ", bucket, " has no gradients");
  at::Tensor buf = *buffers_[bucket];
  reduce_bytes_ += bucket_numels_[bucket] * buf.element_size();
  reduce_hash_ = mix(reduce_hash_, bucket);
  begin_comm();
  OnCommStream on_comm(comm_stream_);
  const auto& bd = bounds_[bucket];
  if (reduce_op_ == Collective::kAllReduce) {
    std::vector<at::Tensor> whole{buf};
    in_flight_.emplace_back(bucket, comm_call([&] { return group_->allreduce(whole, c10d::AllreduceOptions()); }));
    return;
  }
  if (reduce_op_ == Collective::kReduceScatter) {
    at::Tensor out = owned_grad(bucket);  // persistent buckets: in place, at rank * slice, as NCCL allows
    if (accumulate) {                     // see [Note: accumulation into the shard]
      scatter_out_[bucket] = at::empty_like(out);
      out = *scatter_out_[bucket];
      buffer_bytes_ += out.numel() * out.element_size();
      peak_buffer_bytes_ = std::max(peak_buffer_bytes_, buffer_bytes_);
    }
    in_flight_.emplace_back(
        bucket, comm_call([&] { return group_->_reduce_scatter_base(out, buf, c10d::ReduceScatterOptions()); }));
    return;
  }
  for (int64_t r = 0; r < world_; ++r) {
    if (bd[r + 1] == bd[r]) continue;  // this owner has nothing in the bucket
    std::vector<at::Tensor> segment{buf.narrow(0, bd[r], bd[r + 1] - bd[r])};
    c10d::ReduceOptions opts;
    opts.rootRank = r;
    in_flight_.emplace_back(bucket, comm_call([&] { return group_->reduce(segment, opts); }));
  }
}

void BucketComm::wait_reduces() {
  std::vector<int64_t> buckets;
  for (const auto& entry : in_flight_) {
    if (std::find(buckets.begin(), buckets.end(), entry.first) == buckets.end()) buckets.push_back(entry.first);
  }
  finish_buckets(buckets);
  if (!replicate_group_) return;
  {  // see [Note: replicas in backward]
    OnCommStream on_comm(comm_stream_);
    while (next_replicate_ < static_cast<int64_t>(replicate_due_.size())) launch_replicate(next_replicate_++);
    flush_replicate();
    for (auto& work : replicate_works_) comm_call([&] { return work->wait(); });
  }
  replicate_works_.clear();
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
  TORCH_CHECK(param_buffer.dim() == 1 && param_buffer.numel() == bucket_numels_[bucket],
              "BucketComm.gather_start: bucket ", bucket, " needs a flat buffer of ", bucket_numels_[bucket],
              " elements; got shape ", param_buffer.sizes());
  gather_bytes_ += param_buffer.numel() * param_buffer.element_size();
  gather_hash_ = mix(gather_hash_, bucket);
  begin_comm();
  OnCommStream on_comm(comm_stream_);
  at::Tensor out = param_buffer;
  const auto& bd = bounds_[bucket];
  if (gather_op_ == Collective::kAllGather) {
    at::Tensor mine = out.narrow(0, bd[rank_], bd[rank_ + 1] - bd[rank_]);
    gathers_[bucket].push_back(
        comm_call([&] { return gather_group_->_allgather_base(out, mine, c10d::AllgatherOptions()); }));
    return;
  }
  for (int64_t r = 0; r < world_; ++r) {
    if (bd[r + 1] == bd[r]) continue;
    std::vector<at::Tensor> segment{out.narrow(0, bd[r], bd[r + 1] - bd[r])};
    c10d::BroadcastOptions opts;
    opts.rootRank = r;
    gathers_[bucket].push_back(comm_call([&] { return gather_group_->broadcast(segment, opts); }));
  }
}

void BucketComm::gather_wait(int64_t bucket) {
  check_bucket(bucket, "gather_wait");
  {
    OnCommStream on_comm(comm_stream_);
    for (auto& work : gathers_[bucket]) comm_call([&] { return work->wait(); });
  }
  gathers_[bucket].clear();
  end_comm();
}

}  // namespace zerofast
