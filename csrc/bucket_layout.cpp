// See bucket_layout.h. The checks' messages name BucketComm: they run when one is built.
#include "bucket_layout.h"

namespace zerofast {

void BucketLayout::check(int64_t world) const {
  const size_t n = bucket_numels.size();
  TORCH_CHECK(bounds.size() == n && shard_offsets.size() == n && used_numels.size() == n, "BucketComm: used_numels (",
              used_numels.size(), "), bounds (", bounds.size(), ") and shard_offsets (", shard_offsets.size(),
              ") need one entry per bucket (", n, ")");
  for (size_t b = 0; b < n; ++b) {
    const auto& bd = bounds[b];
    TORCH_CHECK(static_cast<int64_t>(bd.size()) == world + 1, "BucketComm: bucket ", b, " has ", bd.size(),
                " bounds for a world of ", world);
    TORCH_CHECK(bd.front() == 0 && bd.back() == bucket_numels[b], "BucketComm: bucket ", b,
                " bounds must run from 0 to its numel ", bucket_numels[b]);
  }
}

OwnedGrads::OwnedGrads(const BucketLayout& layout, int64_t rank, at::Tensor grad_shard,
                       std::vector<at::Tensor> grad_buckets)
    : grad_shard_(std::move(grad_shard)), grad_buckets_(std::move(grad_buckets)) {
  const int64_t n = layout.num_buckets();
  TORCH_CHECK(grad_buckets_.empty() || static_cast<int64_t>(grad_buckets_.size()) == n, "BucketComm: grad_buckets ",
              "needs one tensor per bucket (", n, ") or none; got ", grad_buckets_.size());
  for (size_t b = 0; b < grad_buckets_.size(); ++b) {
    const auto& t = grad_buckets_[b];
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.numel() == layout.bucket_numels[b] &&
                    t.scalar_type() == grad_shard_.scalar_type() && t.device() == grad_shard_.device(),
                "BucketComm: grad_buckets[", b, "] must be a flat contiguous ", grad_shard_.scalar_type(),
                " tensor of ", layout.bucket_numels[b], " elements on ", grad_shard_.device(), "; got ",
                t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
  }
  TORCH_CHECK(grad_shard_.dim() == 1 && grad_shard_.is_contiguous(),
              "BucketComm: grad_shard must be a flat contiguous tensor; got shape ", grad_shard_.sizes());
  for (int64_t b = 0; b < n; ++b) {
    const auto& bd = layout.bounds[b];
    start_.push_back(bd[rank]);
    numel_.push_back(bd[rank + 1] - bd[rank]);
    shard_offset_.push_back(layout.shard_offsets[b]);
    TORCH_CHECK(persistent() || shard_offset_[b] + numel_[b] <= grad_shard_.numel(), "BucketComm: bucket ", b,
                "'s owned range does not fit in grad_shard (", grad_shard_.numel(), " elements)");
  }
}

at::Tensor OwnedGrads::range(int64_t bucket) const {
  if (persistent()) return grad_buckets_[bucket].narrow(0, start_[bucket], numel_[bucket]);
  return grad_shard_.narrow(0, shard_offset_[bucket], numel_[bucket]);
}

}  // namespace zerofast
