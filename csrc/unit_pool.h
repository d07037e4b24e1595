// The pool of stage 3's unit buffers on the CPU ([Note: unit buffer pool] in unit_pool.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zerofast {

struct UnitPoolStats {
  int64_t kept_bytes;  // released memory kept for the next gather
  int64_t limit;       // the most it keeps
  int64_t allocated;   // allocations taken from the system
  int64_t reused;      // allocations served from what was kept
};

// From now on `buffer`'s storage allocates through the pool (its resize_ to n bytes takes a kept
// buffer of n bytes if there is one; its resize_(0) gives the memory back to the pool), which keeps
// at most max(limit, every earlier limit) bytes. The buffer: a CPU tensor with a resizable storage.
void pool_unit_storage(const at::Tensor& buffer, int64_t limit);

UnitPoolStats unit_pool_stats();

}  // namespace zerofast
