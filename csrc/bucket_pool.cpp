// See bucket_pool.h; [Note: bucket pool] and [Note: buffers in flight] are at take().
#include "bucket_pool.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>

namespace zerofast {

BucketPool::BucketPool(at::TensorOptions options, int64_t max_buffers) : options_(options), max_buffers_(max_buffers) {
  TORCH_CHECK(max_buffers_ >= 0, "BucketComm: max_buffers must be 0 (no bound) or positive; got ", max_buffers_);
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
// The pool holds the budget and the counts; the waiting is the reduce/gather core's
// (BucketComm::buffer in buckets.cpp), which owns the reduces in flight.

at::Tensor BucketPool::take(int64_t numel) {
  if (at_budget()) ++over_budget_;  // nothing in flight to wait for
  at::Tensor buffer = reuse_or_allocate(numel);
  bytes_in_use_ += numel * buffer.element_size();
  peak_bytes_ = std::max(peak_bytes_, bytes_in_use_);
  ++live_;
  note_alive();
  return buffer;
}

at::Tensor BucketPool::reuse_or_allocate(int64_t numel) {
  auto kept = std::find_if(kept_.begin(), kept_.end(), [&](const at::Tensor& t) { return t.numel() == numel; });
  if (kept != kept_.end()) {  // see [Note: bucket pool]
    at::Tensor t = std::move(*kept);
    kept_.erase(kept);
    return t;
  }
  // A new buffer: make room by freeing kept ones of other sizes first.
  while (max_buffers_ > 0 && !kept_.empty() && alive() >= max_buffers_) kept_.erase(kept_.begin());
  return at::empty({numel}, options_);
}

void BucketPool::give_back(at::Tensor buffer) {
  bytes_in_use_ -= buffer.numel() * buffer.element_size();
  --live_;
  kept_.push_back(std::move(buffer));
  // The pool keeps at most what the budget leaves ([Note: buffers in flight]).
  while (max_buffers_ > 0 && !kept_.empty() && alive() > max_buffers_) kept_.erase(kept_.begin());
}

at::Tensor BucketPool::scratch_like(const at::Tensor& like) {
  at::Tensor scratch = at::empty_like(like);
  bytes_in_use_ += scratch.numel() * scratch.element_size();
  peak_bytes_ = std::max(peak_bytes_, bytes_in_use_);
  return scratch;
}

void BucketPool::drop_scratch(const at::Tensor& scratch) { bytes_in_use_ -= scratch.numel() * scratch.element_size(); }

int64_t BucketPool::kept_bytes() const {
  int64_t total = 0;
  for (const auto& t : kept_) total += t.numel() * t.element_size();
  return total;
}

void BucketPool::note_alive() {
  peak_live_ = std::max(peak_live_, live_);
  peak_alive_ = std::max(peak_alive_, alive());
}

void BucketPool::reset_peak() {
  peak_live_ = live_;
  peak_alive_ = alive();
}

}  // namespace zerofast
