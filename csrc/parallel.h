// Tasks handed out one at a time, for kernels whose threads should finish together even when
// their cores do not run at the same speed.
//
// at::parallel_for splits a range statically: each thread takes an equal share and the region
// ends when the slowest share does. On a VM whose cores a neighbour slows down now and then (the
// Xeon of bench/RESULTS.md section 33 ran one thread's AMX GEMM share at about half the other's),
// the faster thread then waits; here it takes the next task instead.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace radixserve {

// Runs worker(next) on up to min(threads, n) threads of one parallel region; next() returns the
// next task of [0, n) in order, then n or more once all are taken. A worker sets up its thread
// state (scratch, tile configuration) once and loops: for (i = next(); i < n; i = next()).
template <typename Worker>
void parallel_tasks(int64_t n, Worker&& worker) {
  if (n <= 0) return;
  std::atomic<int64_t> counter{0};
  auto next = [&counter] { return counter.fetch_add(1, std::memory_order_relaxed); };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) { worker(next); });
}

}  // namespace radixserve
