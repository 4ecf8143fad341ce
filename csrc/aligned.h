// std::vector storage on 64-byte boundaries, for the buffers the AMX code reads and writes tile by
// tile. A tile row (64 bytes) that straddles two cache lines costs two accesses: a C++ loop of the
// AMX GEMM's micro-kernel ran at 0.6-0.7 TFLOP/s per core with its operands 16 bytes past a line
// boundary (malloc's alignment, std::vector's default) and at 1.4-1.6 aligned.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace radixserve {

template <typename T>
struct CacheAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheAligned() = default;
  template <typename U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const CacheAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const { return false; }
};

template <typename T>
using AlignedVector = std::vector<T, CacheAligned<T>>;

}  // namespace radixserve
