// Python entry points of the CPU kernels: paged decode attention (picks the
// instruction set, validates the block tables, splits the work over threads,
// and merges split sequences) and the INT4 matmul (int4.h). Tensors arrive as raw pointers; kernels/cpu/__init__.py
// checks dtypes, shapes and contiguity before calling in.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "dispatch.h"
#include "int4_matmul.h"
#include "kv_quant.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace tandem {
namespace {

// Per-thread scratch is padded to whole cache lines so threads never share one.
constexpr size_t kCacheLineFloats = 16;

std::string block_error(const Problem& p, int seq, int block) {
  return "block_tables[" + std::to_string(seq) + "][" + std::to_string(block) + "] = " +
         std::to_string(p.block_tables[static_cast<size_t>(seq) * p.max_blocks_per_seq + block]) +
         " is outside [0, num_blocks=" + std::to_string(p.num_blocks) + ")";
}

void check_context_lens(const Problem& p, bool appending) {
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int lowest = appending ? 1 : 0;
  for (int s = 0; s < p.batch; ++s) {
    const int len = p.context_lens[s];
    if (len < lowest || len > capacity) {
      throw std::invalid_argument("context_lens[" + std::to_string(s) + "] = " + std::to_string(len) +
                                  " is outside [" + std::to_string(lowest) +
                                  ", max_blocks_per_seq * block_size = " + std::to_string(capacity) +
                                  "]" + (appending ? " (fused append needs at least 1)" : ""));
    }
  }
}

// The (block, kv head) unit that sequence s's newest token (position context_len - 1) goes to,
// and the token's slot in it (the block tables have been checked).
struct TokenSlot {
  size_t unit;
  int offset;
};

TokenSlot newest_token_slot(const Problem& p, int s, int kv_head) {
  const int position = p.context_lens[s] - 1;
  const int64_t physical = p.block_tables[static_cast<size_t>(s) * p.max_blocks_per_seq + position / p.block_size];
  return TokenSlot{static_cast<size_t>(physical) * p.num_kv_heads + kv_head, position % p.block_size};
}

// Writes each sequence's new K column and V row, in the caches' dtype, at its newest slot.
void append_tokens(const Problem& p, const void* new_key, const void* new_value) {
  const size_t elem_bytes = dtype_size(p.kv_dtype);
  const size_t row_bytes = p.head_dim * elem_bytes;
  char* key_cache = static_cast<char*>(const_cast<void*>(p.key_cache));
  char* value_cache = static_cast<char*>(const_cast<void*>(p.value_cache));
  for (int s = 0; s < p.batch; ++s) {
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const TokenSlot slot = newest_token_slot(p, s, h);  // units of [head_dim, block_size] elements
      const size_t source = (static_cast<size_t>(s) * p.num_kv_heads + h) * row_bytes;
      const char* key = static_cast<const char*>(new_key) + source;
      for (int d = 0; d < p.head_dim; ++d) {
        std::memcpy(key_cache + ((slot.unit * p.head_dim + d) * p.block_size + slot.offset) * elem_bytes,
                    key + d * elem_bytes, elem_bytes);
      }
      std::memcpy(value_cache + (slot.unit * p.block_size + slot.offset) * row_bytes,
                  static_cast<const char*>(new_value) + source, row_bytes);
    }
  }
}

// Quantizes each sequence's new K and V rows (in the query's dtype) into their newest slots.
void append_quantized_tokens(const Problem& p, const KernelTable& kernels, const void* new_key,
                             const void* new_value) {
  const KvUnit key_unit{key_unit_dtype(p.kv_dtype), p.head_dim, p.block_size};
  const KvUnit value_unit{value_unit_dtype(p.kv_dtype), p.head_dim, p.block_size};
  const size_t row_elems = static_cast<size_t>(p.num_kv_heads) * p.head_dim;
  std::vector<float> keys(row_elems), values(row_elems);  // one sequence's rows in fp32
  uint8_t* key_cache = static_cast<uint8_t*>(const_cast<void*>(p.key_cache));
  uint8_t* value_cache = static_cast<uint8_t*>(const_cast<void*>(p.value_cache));
  const size_t row_bytes = row_elems * dtype_size(p.query_dtype);
  for (int s = 0; s < p.batch; ++s) {
    kernels.convert(static_cast<const char*>(new_key) + s * row_bytes, p.query_dtype, keys.data(), DType::kFloat32,
                    row_elems);
    kernels.convert(static_cast<const char*>(new_value) + s * row_bytes, p.query_dtype, values.data(),
                    DType::kFloat32, row_elems);
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const TokenSlot slot = newest_token_slot(p, s, h);
      write_quantized_token(key_unit, true, keys.data() + h * p.head_dim, slot.offset,
                            key_cache + slot.unit * key_unit.bytes());
      write_quantized_token(value_unit, false, values.data() + h * p.head_dim, slot.offset,
                            value_cache + slot.unit * value_unit.bytes());
    }
  }
}

// Which (sequence, kv head) a partial softmax state belongs to, and where it is.
struct PartialRecord {
  int seq;
  int kv_head;
  PartialState state;
};

// KV bytes a thread claims from its range at a time: small enough that a thread
// that runs out finds most of a slower thread's range still unclaimed, large
// enough that claiming (one compare-and-swap) costs nothing next to attending.
constexpr int64_t kClaimBytes = 128 << 10;
// Ranges a thread may take from others after its own; each can leave two cut
// segments, so this bounds the partial-state slots a call sets aside.
constexpr int kMaxSteals = 3;
constexpr int kRangesPerThread = 1 + kMaxSteals;
// Ranges taken by one thread from another since the module loaded (a statistic; tests read it).
std::atomic<uint64_t> stolen_ranges{0};

// Each thread's range of units still to claim, [next, end), packed into one
// word so that the owner claiming from the front and a thief cutting off the
// back can never both take a unit.
class WorkRanges {
 public:
  explicit WorkRanges(int threads) : ranges_(threads) {}

  void assign(int thread, int64_t begin, int64_t end) { ranges_[thread].bits.store(pack(begin, end)); }

  // Claims up to max_units from the front of the thread's range: [*begin, *end).
  // *range_end is where the range ended at that moment. False once it is empty.
  bool claim(int thread, int64_t max_units, int64_t* begin, int64_t* end, int64_t* range_end) {
    std::atomic<uint64_t>& bits = ranges_[thread].bits;
    uint64_t word = bits.load(std::memory_order_relaxed);
    while (true) {
      const int64_t next = word >> 32, last = word & kLow;
      if (next >= last) return false;
      const int64_t take = std::min(max_units, last - next);
      if (bits.compare_exchange_weak(word, pack(next + take, last), std::memory_order_relaxed)) {
        *begin = next;
        *end = next + take;
        *range_end = last;
        return true;
      }
    }
  }

  // Moves the back half of the largest range left among the other threads, if
  // it holds at least min_units, to this thread's (drained) range.
  bool steal(int thread, int64_t min_units) {
    while (true) {
      int victim = -1;
      int64_t most = 0;
      for (int t = 0; t < static_cast<int>(ranges_.size()); ++t) {
        const uint64_t word = ranges_[t].bits.load(std::memory_order_relaxed);
        const int64_t left = static_cast<int64_t>(word & kLow) - static_cast<int64_t>(word >> 32);
        if (t != thread && left > most) {
          victim = t;
          most = left;
        }
      }
      if (victim < 0 || most < min_units) return false;
      std::atomic<uint64_t>& bits = ranges_[victim].bits;
      uint64_t word = bits.load(std::memory_order_relaxed);
      const int64_t next = word >> 32, last = word & kLow;
      if (last - next < min_units) continue;  // claimed or stolen meanwhile: look again
      const int64_t middle = next + (last - next) / 2;
      if (bits.compare_exchange_strong(word, pack(next, middle), std::memory_order_relaxed)) {
        assign(thread, middle, last);
        stolen_ranges.fetch_add(1, std::memory_order_relaxed);
        return true;
      }
    }
  }

 private:
  static constexpr uint64_t kLow = 0xffffffffu;
  static uint64_t pack(int64_t next, int64_t end) {
    return static_cast<uint64_t>(next) << 32 | static_cast<uint64_t>(end);
  }
  struct alignas(64) Range {  // one cache line each: threads claim without sharing one
    std::atomic<uint64_t> bits{0};
  };
  std::vector<Range> ranges_;
};

void check_block_tables(const Problem& p) {
  for (int s = 0; s < p.batch; ++s) {
    const int32_t* table = p.block_tables + static_cast<size_t>(s) * p.max_blocks_per_seq;
    for (int b = 0; b < num_logical_blocks(p.context_lens[s], p.block_size); ++b) {
      if (table[b] < 0 || table[b] >= p.num_blocks) throw std::invalid_argument(block_error(p, s, b));
    }
  }
}

// Thread t's first unit: an even share of the units, or with whole_sequences the first sequence
// boundary at or past it, so that no sequence is cut between threads.
int64_t range_start(const std::vector<int64_t>& first_unit, int thread, int threads, bool whole_sequences) {
  const int64_t share = first_unit.back() * thread / threads;
  if (!whole_sequences) return share;
  return *std::lower_bound(first_unit.begin(), first_unit.end(), share);
}

// With whole_sequences every sequence is attended start to end by one thread and no thread takes
// another's work: no softmax state is merged, so each row has the bits one thread gives it.
void run_attention(const Problem& p, const KernelTable& kernels, int num_threads, bool whole_sequences) {
  const int num_kv_heads = p.num_kv_heads;
  // Work units are (sequence, logical block, kv head), numbered sequence-major
  // and block-major within a sequence (see Segment).
  std::vector<int64_t> first_unit(p.batch + 1, 0);
  for (int s = 0; s < p.batch; ++s) {
    first_unit[s + 1] = first_unit[s] +
                        static_cast<int64_t>(num_logical_blocks(p.context_lens[s], p.block_size)) * num_kv_heads;
  }
  const size_t row_bytes = p.head_dim * dtype_size(p.query_dtype);
  for (int s = 0; s < p.batch; ++s) {
    if (p.context_lens[s] == 0) {  // nothing to attend to: a zero row, not garbage
      std::memset(static_cast<char*>(p.out) + static_cast<size_t>(s) * p.num_heads * row_bytes, 0,
                  p.num_heads * row_bytes);
    }
  }
  const int64_t total_units = first_unit[p.batch];
  if (total_units == 0) return;
  if (total_units > static_cast<int64_t>(UINT32_MAX)) {
    throw std::invalid_argument("one call attends at most 2^32 - 1 (block, kv head) pairs, got " +
                                std::to_string(total_units) + "; split the batch");
  }
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, whole_sequences ? p.batch : total_units));
  const int64_t unit_bytes = static_cast<int64_t>(KvUnit{key_unit_dtype(p.kv_dtype), p.head_dim, p.block_size}.bytes() +
                                                  KvUnit{value_unit_dtype(p.kv_dtype), p.head_dim, p.block_size}.bytes());
  const int64_t claim_units = std::max<int64_t>(1, kClaimBytes / unit_bytes);

  // Only a range's first and last segment can be cut (middle ones are whole
  // sequences), so each range has two slots of num_kv_heads partial states.
  // A thread's scratch is its segment scratch, then its slots.
  const size_t slot_floats = partial_state_floats(p) * num_kv_heads;
  const int slots_per_thread = 2 * kRangesPerThread;
  const size_t thread_floats = (segment_scratch_floats(p) + slots_per_thread * slot_floats + kCacheLineFloats - 1) /
                               kCacheLineFloats * kCacheLineFloats;
  std::unique_ptr<float[]> scratch(new float[thread_floats * threads]);
  const auto slot_base = [&](size_t slot) {
    return scratch.get() + thread_floats * (slot / slots_per_thread) + segment_scratch_floats(p) +
           (slot % slots_per_thread) * slot_floats;
  };
  // Each slot's cut segment; seq -1 marks an unused slot.
  std::vector<Segment> slot_segment(static_cast<size_t>(threads) * slots_per_thread, Segment{-1, 0, 0});

  WorkRanges work(threads);
  for (int thread = 0; thread < threads; ++thread) {
    work.assign(thread, range_start(first_unit, thread, threads, whole_sequences),
                range_start(first_unit, thread + 1, threads, whole_sequences));
  }
  const std::function<void(int)> task = [&](int thread) {
    float* thread_scratch = scratch.get() + thread_floats * thread;
    for (int range = 0; range < kRangesPerThread; ++range) {
      if (range > 0 && (threads == 1 || whole_sequences || !work.steal(thread, 2 * claim_units))) break;
      Segment open{-1, 0, 0};  // the segment being attended, in sequence-relative units
      int segments_closed = 0;
      const auto close = [&] {
        if (open.seq < 0) return;
        const int64_t seq_units = first_unit[open.seq + 1] - first_unit[open.seq];
        float* partials = nullptr;
        const int slot_in_range = segments_closed++ == 0 ? 0 : 1;
        if (open.unit_begin != 0 || open.unit_end != seq_units) {
          const size_t slot = static_cast<size_t>(thread) * slots_per_thread + 2 * range + slot_in_range;
          partials = slot_base(slot);
          slot_segment[slot] = open;
        }
        kernels.finish_segment(p, open, thread_scratch, partials);
        open.seq = -1;
      };
      int64_t begin, end, range_end;
      while (work.claim(thread, claim_units, &begin, &end, &range_end)) {
        int seq = static_cast<int>(std::upper_bound(first_unit.begin(), first_unit.end(), begin) - first_unit.begin()) - 1;
        for (int64_t unit = begin; unit < end; ++seq) {
          const int64_t local_begin = unit - first_unit[seq];
          const int64_t local_end = std::min(end, first_unit[seq + 1]) - first_unit[seq];
          if (open.seq != seq || open.unit_end != local_begin) {
            close();
            open = Segment{seq, local_begin, local_begin};
          }
          const int64_t prefetch_end = std::min(range_end, first_unit[seq + 1]) - first_unit[seq];
          kernels.attend_units(p, Segment{seq, local_begin, local_end}, open.unit_begin, prefetch_end,
                               thread_scratch);
          open.unit_end = local_end;
          unit = first_unit[seq] + local_end;
        }
      }
      close();
    }
  };
  ThreadPool::instance().run(threads, task);

  // The partial states of each cut (sequence, kv head): the heads a cut segment
  // covered in part, grouped by (sequence, kv head) for the merge.
  std::vector<PartialRecord> records;
  for (size_t index = 0; index < slot_segment.size(); ++index) {
    const Segment& segment = slot_segment[index];
    if (segment.seq < 0) continue;
    const int num_blocks = num_logical_blocks(p.context_lens[segment.seq], p.block_size);
    for (int h = 0; h < num_kv_heads; ++h) {
      const BlockRange range = head_blocks(segment, h, num_kv_heads);
      if (range.empty() || range.whole(num_blocks)) continue;
      records.push_back(PartialRecord{segment.seq, h, partial_state(p, slot_base(index), h)});
    }
  }
  std::stable_sort(records.begin(), records.end(), [](const PartialRecord& a, const PartialRecord& b) {
    return a.seq != b.seq ? a.seq < b.seq : a.kv_head < b.kv_head;
  });
  std::vector<PartialState> parts;
  for (size_t i = 0; i < records.size();) {
    parts.clear();
    size_t j = i;
    for (; j < records.size() && records[j].seq == records[i].seq && records[j].kv_head == records[i].kv_head; ++j) {
      parts.push_back(records[j].state);
    }
    kernels.merge_partials(p, records[i].seq, records[i].kv_head, parts.data(), static_cast<int>(parts.size()));
    i = j;
  }
}

// A quantized KV format's unit needs whole groups of channels and whole vectors of scales.
void check_kv_format(DType kv_dtype, int head_dim, int block_size) {
  if (kv_dtype < DType::kFloat32 || kv_dtype > DType::kK8V4) {
    throw std::invalid_argument("unknown kv dtype code " + std::to_string(static_cast<int>(kv_dtype)));
  }
  if (!is_quantized(kv_dtype)) return;
  const std::string name = kv_dtype == DType::kInt8 ? "int8" : kv_dtype == DType::kInt4 ? "int4" : "k8v4";
  if (head_dim % kQuantGroup != 0) {
    throw std::invalid_argument("a " + name + " KV cache needs head_dim a multiple of " + std::to_string(kQuantGroup) +
                                ", got " + std::to_string(head_dim) + "; use a 16-bit KV cache for this model");
  }
  if (block_size % kQuantBlockMultiple != 0) {
    throw std::invalid_argument("a " + name + " KV cache needs block_size a multiple of " +
                                std::to_string(kQuantBlockMultiple) + ", got " + std::to_string(block_size) +
                                "; choose a block size of 16 or 32");
  }
}

void paged_decode_attention(uintptr_t query, uintptr_t out, int query_dtype, uintptr_t key_cache,
                            uintptr_t value_cache, int kv_dtype, int64_t num_blocks,
                            uintptr_t block_tables, uintptr_t context_lens, int batch,
                            int max_blocks_per_seq, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, double scale, uintptr_t new_key, uintptr_t new_value,
                            int num_threads, bool whole_sequences, const std::string& isa) {
  if (num_threads < 1 || num_threads > kMaxThreads) {
    throw std::invalid_argument("num_threads must be in [1, " + std::to_string(kMaxThreads) +
                                "], got " + std::to_string(num_threads));
  }
  if (head_dim <= 0 || head_dim % kHeadDimMultiple != 0 || head_dim > kMaxHeadDim) {
    throw std::invalid_argument("head_dim must be a positive multiple of " + std::to_string(kHeadDimMultiple) +
                                " up to " + std::to_string(kMaxHeadDim) + ", got " + std::to_string(head_dim));
  }
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) {
    throw std::invalid_argument("num_heads must be a multiple of num_kv_heads");
  }
  check_kv_format(static_cast<DType>(kv_dtype), head_dim, block_size);
  const KernelTable& kernels = select_kernels(isa);
  const Problem p{reinterpret_cast<const void*>(query), reinterpret_cast<void*>(out), static_cast<DType>(query_dtype),
                  reinterpret_cast<const void*>(key_cache), reinterpret_cast<const void*>(value_cache),
                  static_cast<DType>(kv_dtype), reinterpret_cast<const int32_t*>(block_tables),
                  reinterpret_cast<const int32_t*>(context_lens), num_blocks, batch, max_blocks_per_seq,
                  num_heads, num_kv_heads, head_dim, block_size, static_cast<float>(scale)};
  const bool appending = new_key != 0;
  check_context_lens(p, appending);
  check_block_tables(p);  // before the append, so a rejected call leaves the caches as they were
  if (appending && is_quantized(p.kv_dtype)) {
    append_quantized_tokens(p, kernels, reinterpret_cast<const void*>(new_key), reinterpret_cast<const void*>(new_value));
  } else if (appending) {
    append_tokens(p, reinterpret_cast<const void*>(new_key), reinterpret_cast<const void*>(new_value));
  }
  run_attention(p, kernels, num_threads, whole_sequences);
}

void rms_norm(uintptr_t x, uintptr_t weight, uintptr_t out, int dtype, int rows, int hidden, double eps,
              const std::string& isa) {
  if (rows < 0 || hidden < 1 || hidden % kHeadDimMultiple != 0) {
    throw std::invalid_argument("hidden must be a positive multiple of " + std::to_string(kHeadDimMultiple) +
                                ", got " + std::to_string(hidden));
  }
  select_kernels(isa).rms_norm_rows(reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(weight),
                                    reinterpret_cast<void*>(out), static_cast<DType>(dtype), rows, hidden,
                                    static_cast<float>(eps));
}

void rope(uintptr_t x, uintptr_t out, int dtype, uintptr_t positions, uintptr_t cos, uintptr_t sin, int tokens,
          int heads, int head_dim, const std::string& isa) {
  if (tokens < 0 || heads < 1 || head_dim < 2 || head_dim % (2 * kHeadDimMultiple) != 0) {
    throw std::invalid_argument("head_dim must be a positive multiple of " + std::to_string(2 * kHeadDimMultiple) +
                                ", got " + std::to_string(head_dim));
  }
  select_kernels(isa).rope_rows(reinterpret_cast<const void*>(x), reinterpret_cast<void*>(out),
                                static_cast<DType>(dtype), reinterpret_cast<const int64_t*>(positions),
                                reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin), tokens,
                                heads, head_dim);
}

void silu_mul(uintptr_t gate_up, uintptr_t out, int dtype, int rows, int width, const std::string& isa) {
  if (rows < 0 || width < 1 || width % kHeadDimMultiple != 0) {
    throw std::invalid_argument("width must be a positive multiple of " + std::to_string(kHeadDimMultiple) +
                                ", got " + std::to_string(width));
  }
  select_kernels(isa).silu_mul_rows(reinterpret_cast<const void*>(gate_up), reinterpret_cast<void*>(out),
                                    static_cast<DType>(dtype), rows, width);
}

void dense_linear(uintptr_t x, uintptr_t w, int w_dtype, uintptr_t y, int batch, int n, int k, int num_threads,
                  const std::string& isa) {
  if (num_threads < 1 || num_threads > kMaxThreads) throw std::invalid_argument("num_threads out of range");
  if (batch < 1 || batch > kGemvMaxRows || n < 1 || k < 1 || k % kHeadDimMultiple != 0) {
    throw std::invalid_argument("dense_linear takes 1-" + std::to_string(kGemvMaxRows) +
                                " rows and k a positive multiple of " +
                                std::to_string(kHeadDimMultiple) + ", got " + std::to_string(batch) + " rows, k " +
                                std::to_string(k));
  }
  const KernelTable& kernels = select_kernels(isa);
  const GemvProblem p{reinterpret_cast<const float*>(x), reinterpret_cast<const void*>(w),
                      static_cast<DType>(w_dtype), reinterpret_cast<float*>(y), batch, n, k};
  const int threads = std::min(num_threads, n);
  ThreadPool::instance().run(threads, [&](int thread) {
    const auto [begin, end] = split_range(n, threads, thread);
    kernels.gemv_cols(p, begin, end);
  });
}

std::vector<std::string> usable_isas() {
  std::vector<std::string> names;
  for (const KernelTable* table : usable_kernels()) names.emplace_back(table->name);
  return names;
}

std::vector<std::string> integer_dot_isas() {
  std::vector<std::string> names;
  for (const KernelTable* table : usable_kernels()) {
    if (table->integer_dots) names.emplace_back(table->name);
  }
  return names;
}

}  // namespace
}  // namespace tandem

#include "decoder.h"

PYBIND11_MODULE(_cpu_kernels, m) {
  m.doc() = "CPU kernels: paged decode attention and the INT4 matmul (Python API: kernels/cpu/__init__.py, int4.py)";
  m.def("paged_decode_attention", &tandem::paged_decode_attention,
        "Raw-pointer entry; use kernels.cpu.paged_decode_attention instead.",
        py::call_guard<py::gil_scoped_release>());
  m.def("stolen_ranges", [] { return tandem::stolen_ranges.load(); },
        "Ranges of work one thread has taken from another since the module loaded.");
  m.def("int4_linear", &tandem::int4_linear, "Raw-pointer entry; use kernels.cpu.int4_linear instead.",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear_int16", &tandem::int4_linear_int16,
        "Raw-pointer entry; use kernels.cpu.int4_linear(..., activation_bits=16) instead.",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_dequantize", &tandem::int4_dequantize, "Raw-pointer entry; use kernels.cpu.int4.dequantize_into.",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &tandem::rms_norm, "Raw-pointer entry; use kernels.cpu.rms_norm instead.");
  m.def("silu_mul", &tandem::silu_mul, "Raw-pointer entry; use kernels.cpu.silu_mul instead.");
  m.def("rope", &tandem::rope, "Raw-pointer entry; use kernels.cpu.rope instead.");
  m.def("dense_linear", &tandem::dense_linear, "Raw-pointer entry; use kernels.cpu.dense_linear instead.",
        py::call_guard<py::gil_scoped_release>());
  tandem::bind_decoder(m);
  m.def("usable_isas", &tandem::usable_isas, "Instruction sets compiled in and supported here, best first.");
  m.def("integer_dot_isas", &tandem::integer_dot_isas,
        "The usable instruction sets that score quantized keys by integer dot products.");
}
