// The decoder layers of a Llama-family model for decode-sized batches, in C++: one call runs a
// layer's stages, or every layer of a decode step, where Python would make ~20 calls a layer
// (kernels.cpu.decoder, engine/model/native.py). It strings together the very kernels the model's
// fused ops call one by one (RMSNorm, the INT4 and dense matmuls, RoPE, the paged decode
// attention, the elementwise glue), in the same order and with the same roundings, so its
// results are the op-by-op path's.
//
// Included by bindings.cpp after its raw entry points (int4_linear_int16, dense_linear,
// paged_decode_attention), in the same translation unit.
#pragma once

#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "attention.h"
#include "kv_quant.h"

namespace tandem {
namespace {

// One weight of one storage format: the INT4 tiled layout (int4.h) or dense fp32/bf16/fp16 [n, k].
struct LinearPart {
  bool is_int4 = false;
  int n = 0;
  int k = 0;
  uintptr_t codes = 0, scales = 0, mins = 0;  // INT4
  int group_size = 0;
  uintptr_t weight = 0;  // dense
  int weight_dtype = 0;
  uintptr_t bias = 0;  // [n] in the compute dtype, or 0
};

// A fused weight (QKV, gate/up) is one or more parts whose outputs sit side by side.
using FusedLinear = std::vector<LinearPart>;

struct DecoderLayer {
  uintptr_t input_norm = 0, post_norm = 0;  // [hidden], compute dtype
  FusedLinear qkv, o_proj, gate_up, down;
};

struct DecoderShape {
  int dtype = 0;  // the compute dtype (DType)
  int hidden = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int intermediate = 0;
  double eps = 0;
  uintptr_t cos = 0, sin = 0;  // fp32 [max_positions, head_dim]
  int linear_threads = 1;
  std::string isa;
};

// A decode step's paged KV: every layer's caches in one tensor each, layer after layer.
struct PagedKV {
  // [layers, blocks, kv_heads, head_dim, block_size] and [..., block_size, head_dim] in the compute
  // dtype, or for a quantized format both [layers, blocks, kv_heads, unit bytes] (kv_quant.h)
  uintptr_t key = 0, value = 0;
  int kv_dtype = 0;  // DType: the compute dtype or kInt8/kInt4/kK8V4
  int64_t num_blocks = 0;
  int block_size = 0;
  uintptr_t block_tables = 0;  // [tokens, max_blocks_per_seq] int32
  uintptr_t context_lens = 0;  // [tokens] int32, with the new token
  int max_blocks_per_seq = 0;
  double scale = 0;
  int threads = 1;  // each sequence on one thread: the bits of a one-thread call
};

class Decoder {
 public:
  explicit Decoder(DecoderShape shape) : s_(std::move(shape)), kernels_(select_kernels(s_.isa)) {}

  void add_layer(const DecoderLayer& layer) { layers_.push_back(layer); }

  // Where the calls' time went, in seconds since profiling was turned on (off by default: two
  // clock reads per matmul and attention call): {matmuls, attention}; the rest of a call is the
  // norms, RoPE and elementwise glue.
  void set_profiling(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    profiling_ = on;
    linear_ns_ = attention_ns_ = 0;
  }
  std::pair<double, double> profile() const { return {linear_ns_ * 1e-9, attention_ns_ * 1e-9}; }
  int num_layers() const { return static_cast<int>(layers_.size()); }

  // hidden [tokens, hidden] -> q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim].
  void pre_proj(int layer, uintptr_t hidden, uintptr_t positions, int tokens, uintptr_t q, uintptr_t k, uintptr_t v) {
    std::lock_guard<std::mutex> lock(mutex_);
    run_pre_proj(layers_.at(layer), ptr(hidden), reinterpret_cast<const int64_t*>(positions), tokens, ptr(q), ptr(k),
                 ptr(v));
  }

  // out [tokens, hidden] = the layer's output from its input hidden and attention output
  // attn [tokens, heads * head_dim]; out may be hidden.
  void post_proj(int layer, uintptr_t hidden, uintptr_t attn, int tokens, uintptr_t out) {
    std::lock_guard<std::mutex> lock(mutex_);
    run_post_proj(layers_.at(layer), ptr(hidden), ptr(attn), tokens, ptr(out));
  }

  // Every layer of a decode step (one token per sequence, K/V appended to the paged caches),
  // hidden [tokens, hidden] updated in place.
  void decode(uintptr_t hidden, uintptr_t positions, int tokens, const PagedKV& kv) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t q_size = static_cast<size_t>(tokens) * s_.num_heads * s_.head_dim;
    const size_t kv_size = static_cast<size_t>(tokens) * s_.num_kv_heads * s_.head_dim;
    char* q = buffer(q_buf_, q_size);
    char* k = buffer(k_buf_, kv_size);
    char* v = buffer(v_buf_, kv_size);
    char* attn = buffer(attn_buf_, q_size);
    const DType format = static_cast<DType>(kv.kv_dtype);
    const size_t layer_units = static_cast<size_t>(kv.num_blocks) * s_.num_kv_heads;
    const size_t key_layer_bytes = layer_units * KvUnit{key_unit_dtype(format), s_.head_dim, kv.block_size}.bytes();
    const size_t value_layer_bytes = layer_units * KvUnit{value_unit_dtype(format), s_.head_dim, kv.block_size}.bytes();
    for (int i = 0; i < num_layers(); ++i) {
      run_pre_proj(layers_[i], ptr(hidden), reinterpret_cast<const int64_t*>(positions), tokens, q, k, v);
      const int64_t start = now_ns();
      paged_decode_attention(addr(q), addr(attn), s_.dtype, kv.key + i * key_layer_bytes, kv.value + i * value_layer_bytes,
                             kv.kv_dtype, kv.num_blocks, kv.block_tables, kv.context_lens, tokens,
                             kv.max_blocks_per_seq, s_.num_heads, s_.num_kv_heads, s_.head_dim, kv.block_size,
                             kv.scale, addr(k), addr(v), kv.threads, /*whole_sequences=*/true, s_.isa);
      if (profiling_) attention_ns_ += now_ns() - start;
      run_post_proj(layers_[i], ptr(hidden), attn, tokens, ptr(hidden));
    }
  }

 private:
  static char* ptr(uintptr_t address) { return reinterpret_cast<char*>(address); }
  static uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }
  DType dtype() const { return static_cast<DType>(s_.dtype); }
  size_t elem() const { return dtype_size(dtype()); }

  // A scratch buffer with room for num_elements in fp32 (the widest dtype), kept between calls:
  // no allocation once warm.
  static char* buffer(std::vector<char>& storage, size_t num_elements) {
    const size_t num_bytes = num_elements * sizeof(float);
    if (storage.size() < num_bytes) storage.resize(num_bytes);
    return storage.data();
  }

  void run_pre_proj(const DecoderLayer& w, const char* hidden, const int64_t* positions, int tokens, char* q,
                    char* k, char* v) {
    const int q_cols = s_.num_heads * s_.head_dim, kv_cols = s_.num_kv_heads * s_.head_dim;
    const int qkv_cols = q_cols + 2 * kv_cols;
    char* normed = buffer(norm_buf_, static_cast<size_t>(tokens) * s_.hidden);
    char* qkv = buffer(qkv_buf_, static_cast<size_t>(tokens) * qkv_cols);
    kernels_.rms_norm_rows(hidden, ptr(w.input_norm), normed, dtype(), tokens, s_.hidden, static_cast<float>(s_.eps));
    linear(w.qkv, normed, qkv, tokens, qkv_cols);
    const float* cos = reinterpret_cast<const float*>(s_.cos);
    const float* sin = reinterpret_cast<const float*>(s_.sin);
    for (int t = 0; t < tokens; ++t) {
      const char* row = qkv + static_cast<size_t>(t) * qkv_cols * elem();
      kernels_.rope_rows(row, q + static_cast<size_t>(t) * q_cols * elem(), dtype(), positions + t, cos, sin, 1,
                         s_.num_heads, s_.head_dim);
      kernels_.rope_rows(row + q_cols * elem(), k + static_cast<size_t>(t) * kv_cols * elem(), dtype(), positions + t,
                         cos, sin, 1, s_.num_kv_heads, s_.head_dim);
      std::memcpy(v + static_cast<size_t>(t) * kv_cols * elem(), row + (q_cols + kv_cols) * elem(), kv_cols * elem());
    }
  }

  void run_post_proj(const DecoderLayer& w, const char* hidden, const char* attn, int tokens, char* out) {
    const size_t rows_hidden = static_cast<size_t>(tokens) * s_.hidden;
    char* projected = buffer(proj_buf_, rows_hidden);
    char* residual = buffer(residual_buf_, rows_hidden);
    char* normed = buffer(norm_buf_, rows_hidden);
    char* gate_up = buffer(gate_up_buf_, static_cast<size_t>(tokens) * 2 * s_.intermediate);
    char* act = buffer(act_buf_, static_cast<size_t>(tokens) * s_.intermediate);
    linear(w.o_proj, attn, projected, tokens, s_.hidden);
    kernels_.add_rows(hidden, projected, residual, dtype(), tokens, s_.hidden, tokens);
    kernels_.rms_norm_rows(residual, ptr(w.post_norm), normed, dtype(), tokens, s_.hidden,
                           static_cast<float>(s_.eps));
    linear(w.gate_up, normed, gate_up, tokens, 2 * s_.intermediate);
    kernels_.silu_mul_rows(gate_up, act, dtype(), tokens, s_.intermediate);
    linear(w.down, act, projected, tokens, s_.hidden);
    kernels_.add_rows(residual, projected, out, dtype(), tokens, s_.hidden, tokens);
  }

  // y [tokens, cols] = x @ W^T for a fused weight: each part into its own columns.
  void linear(const FusedLinear& parts, const char* x, char* y, int tokens, int cols) {
    if (parts.size() == 1) {
      apply(parts[0], x, y, tokens);
      return;
    }
    int col = 0;
    for (const LinearPart& part : parts) {
      char* part_out = buffer(part_buf_, static_cast<size_t>(tokens) * part.n);
      apply(part, x, part_out, tokens);
      for (int t = 0; t < tokens; ++t) {
        std::memcpy(y + (static_cast<size_t>(t) * cols + col) * elem(),
                    part_out + static_cast<size_t>(t) * part.n * elem(), part.n * elem());
      }
      col += part.n;
    }
  }

  // One part, as its LinearWeight applies it: INT4 straight in the dtype; dense through the
  // fp32 GEMV, rounded to the dtype; then the bias added in the dtype.
  void apply(const LinearPart& part, const char* x, char* y, int tokens) {
    const int64_t start = now_ns();
    if (part.is_int4) {
      // decode-sized batches: int16 x, as the op-by-op path (engine/quant/int4.py MAX_INT16_ROWS)
      int4_linear_int16(addr(x), part.codes, part.scales, part.mins, addr(y), s_.dtype, tokens, part.n, part.k,
                        part.group_size, s_.linear_threads, s_.isa);
    } else {
      float* x32 = reinterpret_cast<float*>(buffer(x32_buf_, static_cast<size_t>(tokens) * part.k));
      float* y32 = reinterpret_cast<float*>(buffer(y32_buf_, static_cast<size_t>(tokens) * part.n));
      kernels_.convert(x, dtype(), x32, DType::kFloat32, static_cast<size_t>(tokens) * part.k);
      dense_linear(addr(x32), part.weight, part.weight_dtype, addr(y32), tokens, part.n, part.k, s_.linear_threads,
                   s_.isa);
      kernels_.convert(y32, DType::kFloat32, y, dtype(), static_cast<size_t>(tokens) * part.n);
    }
    if (part.bias) kernels_.add_rows(y, ptr(part.bias), y, dtype(), tokens, part.n, 1);
    if (profiling_) linear_ns_ += now_ns() - start;
  }

  int64_t now_ns() const {
    if (!profiling_) return 0;
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  DecoderShape s_;
  const KernelTable& kernels_;
  std::vector<DecoderLayer> layers_;
  std::mutex mutex_;  // one call at a time: the scratch buffers are shared
  bool profiling_ = false;
  int64_t linear_ns_ = 0, attention_ns_ = 0;
  std::vector<char> norm_buf_, qkv_buf_, proj_buf_, residual_buf_, gate_up_buf_, act_buf_, part_buf_, x32_buf_,
      y32_buf_, q_buf_, k_buf_, v_buf_, attn_buf_;
};

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

// kernels.cpu.decoder's view: raw pointers in, the GIL released while a call runs.
inline void bind_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<LinearPart>(m, "LinearPart")
      .def(py::init<>())
      .def_readwrite("is_int4", &LinearPart::is_int4)
      .def_readwrite("n", &LinearPart::n)
      .def_readwrite("k", &LinearPart::k)
      .def_readwrite("codes", &LinearPart::codes)
      .def_readwrite("scales", &LinearPart::scales)
      .def_readwrite("mins", &LinearPart::mins)
      .def_readwrite("group_size", &LinearPart::group_size)
      .def_readwrite("weight", &LinearPart::weight)
      .def_readwrite("weight_dtype", &LinearPart::weight_dtype)
      .def_readwrite("bias", &LinearPart::bias);
  py::class_<DecoderLayer>(m, "DecoderLayer")
      .def(py::init<>())
      .def_readwrite("input_norm", &DecoderLayer::input_norm)
      .def_readwrite("post_norm", &DecoderLayer::post_norm)
      .def_readwrite("qkv", &DecoderLayer::qkv)
      .def_readwrite("o_proj", &DecoderLayer::o_proj)
      .def_readwrite("gate_up", &DecoderLayer::gate_up)
      .def_readwrite("down", &DecoderLayer::down);
  py::class_<DecoderShape>(m, "DecoderShape")
      .def(py::init<>())
      .def_readwrite("dtype", &DecoderShape::dtype)
      .def_readwrite("hidden", &DecoderShape::hidden)
      .def_readwrite("num_heads", &DecoderShape::num_heads)
      .def_readwrite("num_kv_heads", &DecoderShape::num_kv_heads)
      .def_readwrite("head_dim", &DecoderShape::head_dim)
      .def_readwrite("intermediate", &DecoderShape::intermediate)
      .def_readwrite("eps", &DecoderShape::eps)
      .def_readwrite("cos", &DecoderShape::cos)
      .def_readwrite("sin", &DecoderShape::sin)
      .def_readwrite("linear_threads", &DecoderShape::linear_threads)
      .def_readwrite("isa", &DecoderShape::isa);
  py::class_<PagedKV>(m, "PagedKV")
      .def(py::init<>())
      .def_readwrite("key", &PagedKV::key)
      .def_readwrite("value", &PagedKV::value)
      .def_readwrite("kv_dtype", &PagedKV::kv_dtype)
      .def_readwrite("num_blocks", &PagedKV::num_blocks)
      .def_readwrite("block_size", &PagedKV::block_size)
      .def_readwrite("block_tables", &PagedKV::block_tables)
      .def_readwrite("context_lens", &PagedKV::context_lens)
      .def_readwrite("max_blocks_per_seq", &PagedKV::max_blocks_per_seq)
      .def_readwrite("scale", &PagedKV::scale)
      .def_readwrite("threads", &PagedKV::threads);
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<DecoderShape>())
      .def("add_layer", &Decoder::add_layer)
      .def_property_readonly("num_layers", &Decoder::num_layers)
      .def("pre_proj", &Decoder::pre_proj, py::call_guard<py::gil_scoped_release>())
      .def("post_proj", &Decoder::post_proj, py::call_guard<py::gil_scoped_release>())
      .def("decode", &Decoder::decode, py::call_guard<py::gil_scoped_release>())
      .def("set_profiling", &Decoder::set_profiling)
      .def("profile", &Decoder::profile);
}

}  // namespace
}  // namespace tandem
