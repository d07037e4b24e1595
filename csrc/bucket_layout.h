// The bucket layout as the engine holds it (zerofast/layout.py decides it), and where the reduces
// leave this rank's owned gradient ranges. Plain data with its checks: the reduce/gather core
// (buckets.h) and the replica reducer (replica_reducer.h) read it, neither owns the other's view.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zerofast {

// One process group's buckets, as zerofast/layout.py cut them.
struct BucketLayout {
  // bucket_numels[b]: buffer length of bucket b (padding included); used_numels[b]: how many of
  // those hold parameters (the rest is padding, kept zero: [Note: padding]).
  std::vector<int64_t> bucket_numels;
  std::vector<int64_t> used_numels;
  // bounds[b]: world + 1 offsets; rank r owns [bounds[b][r], bounds[b][r + 1]) of bucket b.
  std::vector<std::vector<int64_t>> bounds;
  // shard_offsets[b]: where bucket b's owned range starts in this rank's grad_shard.
  std::vector<int64_t> shard_offsets;
  // flat: every bucket's slices are equal (reduce_scatter / all_gather); else one reduce to and
  // one broadcast from each owner's segment.
  bool flat = true;

  int64_t num_buckets() const { return static_cast<int64_t>(bucket_numels.size()); }
  // One entry per bucket in every list, and each bucket's bounds run over the whole bucket, one
  // range per rank of a group of `world` (TORCH_CHECK, naming what does not fit).
  void check(int64_t world) const;
};

// Where each bucket's reduced owned range lives: in grad_shard (the reduce's result is copied or
// added there out of a pooled buffer), or, with persistent buckets (stage 1: [Note: grads as
// bucket views] in buckets.cpp), in the bucket itself, where the reduce left it.
class OwnedGrads {
 public:
  // grad_shard: this rank's flat reduced-gradient shard, in the reduce dtype (empty with
  // persistent buckets); grad_buckets: empty, or one flat tensor per bucket of that dtype and device.
  OwnedGrads(const BucketLayout& layout, int64_t rank, at::Tensor grad_shard, std::vector<at::Tensor> grad_buckets);

  bool persistent() const { return !grad_buckets_.empty(); }
  const at::Tensor& persistent_bucket(int64_t bucket) const { return grad_buckets_[bucket]; }
  // Bucket b's owned range: where it starts in the bucket, how long it is, and the tensor that
  // holds its reduced values (a view of grad_shard, or of the persistent bucket).
  int64_t start(int64_t bucket) const { return start_[bucket]; }
  int64_t numel(int64_t bucket) const { return numel_[bucket]; }
  at::Tensor range(int64_t bucket) const;
  // grad_shard itself, and bucket b's offset in it (consecutive buckets' ranges are adjacent).
  const at::Tensor& shard() const { return grad_shard_; }
  int64_t shard_offset(int64_t bucket) const { return shard_offset_[bucket]; }

 private:
  at::Tensor grad_shard_;
  std::vector<at::Tensor> grad_buckets_;
  std::vector<int64_t> start_;
  std::vector<int64_t> numel_;
  std::vector<int64_t> shard_offset_;
};

}  // namespace zerofast
