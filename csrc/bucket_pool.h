// The pool of gradient bucket buffers: buffers handed out while a bucket is filled and reduced,
// kept for reuse once released, within a budget of buffers alive at once, and the counters that
// show what was alive. It never waits for a collective: when the budget is spent, the reduce/gather
// core (buckets.h), which owns the reduces in flight, waits for the oldest one before taking a
// buffer. See [Note: bucket pool] and [Note: buffers in flight] in bucket_pool.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zerofast {

class BucketPool {
 public:
  // options: the buffers' dtype and device (the reduce dtype); max_buffers: at most this many
  // buffers alive at once, in use or kept for reuse (0: no bound).
  BucketPool(at::TensorOptions options, int64_t max_buffers);

  // Whether a buffer taken now would exceed the budget; the caller first waits for reduces in
  // flight until it is not, where there are any ([Note: buffers in flight]).
  bool at_budget() const { return max_buffers_ > 0 && live_ >= max_buffers_; }
  // A buffer of numel elements, kept or new, counted in use (its contents are left as they were).
  // Taken at the budget (no reduce was in flight to wait for) it is counted in over_budget().
  at::Tensor take(int64_t numel);
  // A buffer taken here, back for reuse: only once its collective has been waited for, so that no
  // stream still uses it ([Note: comm stream] in buckets.cpp).
  void give_back(at::Tensor buffer);
  // A tensor shaped as `like`, not pooled, counted in bytes_in_use() until dropped (an accumulating
  // reduce_scatter's output: [Note: accumulation into the shard] in buckets.cpp).
  at::Tensor scratch_like(const at::Tensor& like);
  void drop_scratch(const at::Tensor& scratch);

  // Bytes of buffers (and scratch) in use now, the most in use at once since construction, and
  // those kept for reuse (never more than that peak).
  int64_t bytes_in_use() const { return bytes_in_use_; }
  int64_t peak_bytes() const { return peak_bytes_; }
  int64_t kept_bytes() const;
  // Buffers in use now (being filled or being reduced), the most in use at once since the last
  // reset_peak(), the most alive at once (in use + kept) since then, and how often a buffer was
  // taken beyond the budget (buckets filled out of order: see [Note: buffers in flight]).
  int64_t live() const { return live_; }
  int64_t peak_live() const { return peak_live_; }
  int64_t peak_alive() const { return peak_alive_; }
  int64_t over_budget() const { return over_budget_; }
  int64_t max_buffers() const { return max_buffers_; }
  void reset_peak();

 private:
  at::Tensor reuse_or_allocate(int64_t numel);
  void note_alive();
  int64_t alive() const { return live_ + static_cast<int64_t>(kept_.size()); }

  at::TensorOptions options_;
  int64_t max_buffers_;
  std::vector<at::Tensor> kept_;  // released buffers, for reuse, oldest first
  int64_t bytes_in_use_ = 0;
  int64_t peak_bytes_ = 0;
  int64_t live_ = 0;
  int64_t peak_live_ = 0;
  int64_t peak_alive_ = 0;
  int64_t over_budget_ = 0;
};

}  // namespace zerofast
