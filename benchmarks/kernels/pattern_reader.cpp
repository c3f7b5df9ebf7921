// A pure reader of the CPU attention kernel's memory access order, for
// benchmarks/kernels/cpu_attention.py: how fast the paged pool can be streamed in the
// kernel's order when there is no arithmetic to overlap.
//
// It mirrors the kernel's walk (kernels/cpu/attention_impl.h, bindings.cpp), and
// a change there must be carried here: each sequence's (block, kv head) units
// block-major, the batch's units split evenly over the threads (the kernel's
// threads also take work from one another when one runs out; the reader, with
// no arithmetic to fall behind on, keeps the even split). It reads a
// unit's K slice (the kernel's key columns), then its V rows, in address order,
// prefetching the next unit's alongside, and adds every 32 bytes into a running sum so no load can be
// dropped. Call l of `reps` reads layer (first_layer + l) % num_layers of the
// caches, as the benchmark's kernel calls rotate over layers. Built by the
// benchmark with g++; not part of the product.
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

// Every thread waits here until all have arrived; reusable across rounds.
class SpinBarrier {
 public:
  explicit SpinBarrier(int count) : count_(count) {}
  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == generation) _mm_pause();
  }

 private:
  const int count_;
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

__m256 read_rows(const char* rows, const char* next_rows, size_t bytes, __m256 sum) {
  for (size_t offset = 0; offset < bytes; offset += 64) {
    if (next_rows != nullptr) _mm_prefetch(next_rows + offset, _MM_HINT_T0);
    sum = _mm256_add_ps(sum, _mm256_loadu_ps(reinterpret_cast<const float*>(rows + offset)));
    sum = _mm256_add_ps(sum, _mm256_loadu_ps(reinterpret_cast<const float*>(rows + offset + 32)));
  }
  return sum;
}

}  // namespace

// Seconds per call, averaged over `reps` calls after one untimed warm-up call.
// key_cache/value_cache: [num_layers, num_blocks, num_kv_heads, head_bytes] (the kernel's
// keys are [head_dim, block_size] and values [block_size, head_dim] per slice: the same bytes);
// block_tables: [batch, blocks_per_seq]; every sequence spans all its blocks.
// head_bytes is block_size * head_dim * element size, a multiple of 64. *checksum
// receives the sum of every fp32 word read by all reps + 1 calls (the tests' proof
// that exactly the table's blocks were read).
extern "C" double read_pattern(const char* key_cache, const char* value_cache, int num_layers, int first_layer,
                               int64_t num_blocks, const int32_t* block_tables, int batch,
                               int blocks_per_seq, int num_kv_heads, int64_t head_bytes, int num_threads,
                               int reps, double* checksum) {
  const int64_t units_per_seq = static_cast<int64_t>(blocks_per_seq) * num_kv_heads;
  const int64_t total_units = units_per_seq * batch;
  const size_t layer_bytes = static_cast<size_t>(num_blocks) * num_kv_heads * head_bytes;
  const auto unit_offset = [&](int64_t unit) {
    const int64_t seq = unit / units_per_seq;
    const int64_t rest = unit % units_per_seq;
    const int64_t block = block_tables[seq * blocks_per_seq + rest / num_kv_heads];
    return (static_cast<size_t>(block) * num_kv_heads + rest % num_kv_heads) * head_bytes;
  };
  SpinBarrier barrier(num_threads);
  std::vector<double> sinks(num_threads * 8, 0.0);  // a cache line per thread
  std::chrono::steady_clock::time_point start;
  const auto work = [&](int thread) {
    const int64_t begin = total_units * thread / num_threads;
    const int64_t end = total_units * (thread + 1) / num_threads;
    __m256 sum = _mm256_setzero_ps();
    for (int call = 0; call <= reps; ++call) {  // call 0 is the warm-up
      barrier.wait();
      if (call == 1 && thread == 0) start = std::chrono::steady_clock::now();
      const size_t layer = static_cast<size_t>((first_layer + call) % num_layers) * layer_bytes;
      const char* keys = key_cache + layer;
      const char* values = value_cache + layer;
      for (int64_t unit = begin; unit < end; ++unit) {
        const size_t offset = unit_offset(unit);
        const bool has_next = unit + 1 < end;
        const size_t next = has_next ? unit_offset(unit + 1) : 0;
        sum = read_rows(keys + offset, has_next ? keys + next : nullptr, head_bytes, sum);
        sum = read_rows(values + offset, has_next ? values + next : nullptr, head_bytes, sum);
      }
    }
    barrier.wait();
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (float lane : lanes) sinks[thread * 8] += lane;
  };
  std::vector<std::thread> workers;
  for (int thread = 1; thread < num_threads; ++thread) workers.emplace_back(work, thread);
  work(0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (std::thread& worker : workers) worker.join();
  *checksum = 0.0;
  for (int thread = 0; thread < num_threads; ++thread) *checksum += sinks[thread * 8];
  return seconds / reps;
}
