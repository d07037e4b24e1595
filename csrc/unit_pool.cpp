// The pool of stage 3's unit buffers on the CPU: an allocator given to a unit buffer's storage, so
// that its resize_(n) at a gather takes memory a released unit gave back, already faulted in, and its
// resize_(0) at the release keeps the memory for the next gather instead of returning it to the
// system. See [Note: unit buffer pool].
#include "unit_pool.h"

#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace zerofast {

// [Note: unit buffer pool]
// Stage 3 gives each unit's buffer storage only while the unit is gathered (UnitBuffers in
// zerofast/stage3/runtime.py: storage resize_ to the unit's bytes, then to 0). On the CPU, torch's
// allocator takes a buffer of more than a few MiB from the system afresh each time (glibc maps it,
// and unmaps it when freed), so every gather faults in and zeroes every page of the unit before it
// can write it: the gather of a unit from its shard file measured at 14-23% of the page cache's read
// rate for that reason (docs/benchmarks.md, the shards on disk). Given to a storage
// (storage.set_allocator), this allocator keeps what a release frees, by exact size, up to a limit of
// bytes kept, and hands it to the next resize_ of that size: the pages are resident already. Only
// the storage's own allocations go through it (resize_ calls storage->allocator()); its views, the
// model's parameters, are untouched. What is kept is this process's memory, like a caching
// allocator's: at most `limit` bytes, the largest a caller asked for (stage 3 asks for two of its
// largest units). The pool is never destroyed (a storage freed during the interpreter's exit still
// gives back into it); what it keeps goes with the process.
namespace {

class UnitPool;
UnitPool& unit_pool();

class UnitPool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto kept = free_.find(n);
      if (kept != free_.end() && !kept->second.empty()) {
        data = kept->second.back();
        kept->second.pop_back();
        kept_bytes_ -= static_cast<int64_t>(n);
        reused_ += 1;
      } else {
        allocated_ += 1;
      }
    }
    if (data == nullptr && n > 0) {
      data = c10::alloc_cpu(n);
    }
    return {data, new Block{data, n}, &UnitPool::give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  void raise_limit(int64_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = std::max(limit_, limit);
  }

  UnitPoolStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {kept_bytes_, limit_, allocated_, reused_};
  }

 private:
  struct Block {
    void* data;
    size_t nbytes;
  };

  static void give_back(void* context) {
    auto* block = static_cast<Block*>(context);
    unit_pool().keep(block->data, block->nbytes);
    delete block;
  }

  void keep(void* data, size_t n) {
    if (data == nullptr) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_bytes_ + static_cast<int64_t>(n) <= limit_) {
        free_[n].push_back(data);
        kept_bytes_ += static_cast<int64_t>(n);
        return;
      }
    }
    c10::free_cpu(data);
  }

  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // kept buffers by their exact size
  int64_t kept_bytes_ = 0;
  int64_t limit_ = 0;
  int64_t allocated_ = 0;  // allocations from the system
  int64_t reused_ = 0;     // allocations served from what was kept
};

UnitPool& unit_pool() {
  static auto* pool = new UnitPool();  // never destroyed: see the note
  return *pool;
}

}  // namespace

void pool_unit_storage(const at::Tensor& buffer, int64_t limit) {
  TORCH_CHECK(buffer.device().is_cpu(), "pool_unit_storage: the unit buffer must be on the CPU; got ", buffer.device());
  TORCH_CHECK(limit >= 0, "pool_unit_storage: limit must be >= 0 bytes; got ", limit);
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->resizable(), "pool_unit_storage: the unit buffer's storage is not resizable");
  UnitPool& pool = unit_pool();
  pool.raise_limit(limit);
  storage->set_allocator(&pool);
}

UnitPoolStats unit_pool_stats() { return unit_pool().stats(); }

}  // namespace zerofast
