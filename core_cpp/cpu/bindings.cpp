// The pybind11 module tinyvllm._cpu: declarations only. Pointers arrive as integers (the ops layer
// passes tensor.data_ptr()); sizes are checked in linear.cpp. The GIL is released while a kernel
// runs. Docstrings live in service/tinyvllm/_cpu.pyi.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <mutex>

#include "attention.h"
#include "decoder.h"
#include "linear.h"
#include "thread_pool.h"

namespace py = pybind11;
namespace cpu = tinyvllm::cpu;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void linear(uintptr_t out, uintptr_t x, uintptr_t w, uintptr_t bias, int qtype, int64_t m,
            int64_t n, int64_t k, int64_t x_stride, int64_t out_stride, const std::string& isa) {
  cpu::quantized_linear(ptr<const float>(x), x_stride, ptr<const uint8_t>(w), qtype,
                        bias ? ptr<const float>(bias) : nullptr, ptr<float>(out), out_stride, m,
                        n, k, isa);
}

void int8_linear(uintptr_t out, uintptr_t x, uintptr_t w, uintptr_t w_scale, uintptr_t input_scale,
                 float scale_divisor, uintptr_t bias, int64_t m, int64_t n, int64_t k,
                 int64_t x_stride, int64_t out_stride, const std::string& isa) {
  cpu::int8_linear(ptr<const float>(x), x_stride, ptr<const int8_t>(w), ptr<const float>(w_scale),
                   input_scale ? ptr<const float>(input_scale) : nullptr, scale_divisor,
                   bias ? ptr<const float>(bias) : nullptr, ptr<float>(out), out_stride, m, n, k,
                   isa);
}

void dequantize_rows(uintptr_t out, uintptr_t w, int qtype, int64_t num_rows, int64_t k,
                     uintptr_t row_ids, int64_t num_ids) {
  cpu::dequantize_rows(ptr<const uint8_t>(w), qtype, num_rows, k, ptr<const int64_t>(row_ids),
                       num_ids, ptr<float>(out));
}

// A cache dtype by its torch name: "float32" or "float16".
cpu::KvType kv_type(const std::string& name) {
  if (name == "float32") return cpu::KvType::F32;
  if (name == "float16") return cpu::KvType::F16;
  throw std::invalid_argument("kv_cache_dtype: the CPU kernels read float32 or float16 caches, "
                              "got '" + name + "'");
}

void decode_attention(uintptr_t out, uintptr_t q, int64_t q_stride, uintptr_t cache,
                      int64_t num_blocks, int64_t block_size, int64_t hkv, int64_t d, int64_t h,
                      uintptr_t block_tables, int64_t table_stride, uintptr_t seq_lens, int64_t b,
                      float scale, const std::string& kv_cache_dtype) {
  cpu::paged_decode_attention(ptr<float>(out), ptr<const float>(q), q_stride,
                              ptr<const void>(cache), kv_type(kv_cache_dtype), num_blocks,
                              block_size, hkv, d, h, ptr<const int32_t>(block_tables),
                              table_stride, ptr<const int32_t>(seq_lens), b, scale);
}

// y[i] = x[i] as IEEE half bits, rounded to nearest even (the cache writes' conversion).
void to_float16(uintptr_t y, uintptr_t x, int64_t n, const std::string& isa) {
  if (n < 0) throw std::invalid_argument("to_float16: n must be >= 0, got " + std::to_string(n));
  cpu::select_kernels(isa).to_f16(ptr<const float>(x), ptr<uint16_t>(y), n);
}

// Per layer, kLayerFields integers: input_norm; qkv as 3 shards of (w, qtype, rows) in row
// order (rows 0: no shard); qkv_bias (0: none); o_w, o_qtype; post_norm; gate_up as 2 shards;
// down_w, down_qtype; kv_cache.
constexpr size_t kLayerFields = 23;

std::vector<cpu::LayerParams> layer_params(const std::vector<uintptr_t>& f) {
  if (f.size() % kLayerFields) {
    throw std::invalid_argument("decoder_layers: layers must hold 23 integers per layer, got " +
                                std::to_string(f.size()));
  }
  std::vector<cpu::LayerParams> out;
  for (size_t i = 0; i < f.size(); i += kLayerFields) {
    auto packed = [&](size_t j) {
      return cpu::PackedWeight{ptr<const uint8_t>(f[i + j]), static_cast<int>(f[i + j + 1])};
    };
    auto shard = [&](size_t j) {
      return cpu::PackedShard{packed(j), static_cast<int64_t>(f[i + j + 2])};
    };
    cpu::LayerParams l{};
    l.input_norm = ptr<const float>(f[i]);
    for (size_t s = 0; s < 3; ++s) l.qkv[s] = shard(1 + 3 * s);
    l.qkv_bias = f[i + 10] ? ptr<const float>(f[i + 10]) : nullptr;
    l.o = packed(11);
    l.post_norm = ptr<const float>(f[i + 13]);
    for (size_t s = 0; s < 2; ++s) l.gate_up[s] = shard(14 + 3 * s);
    l.down = packed(20);
    l.kv_cache = ptr<void>(f[i + 22]);
    out.push_back(l);
  }
  return out;
}

void decoder_layers(uintptr_t residual, uintptr_t out, const std::vector<uintptr_t>& layers,
                    uintptr_t final_norm, const std::vector<int64_t>& dims, float eps,
                    float scale, int64_t num_tokens, uintptr_t positions, uintptr_t slot_mapping,
                    uintptr_t cos_sin, int64_t max_position, uintptr_t query_start_loc,
                    uintptr_t seq_lens, int64_t num_seqs, uintptr_t block_tables,
                    int64_t table_stride, int64_t num_blocks, int64_t block_size,
                    const std::string& kv_cache_dtype, const std::string& isa) {
  if (dims.size() != 5) {
    throw std::invalid_argument("decoder_layers: dims = (hidden, num_heads, num_kv_heads, "
                                "head_dim, intermediate)");
  }
  const cpu::DecoderShape shape{dims[0], dims[1], dims[2], dims[3], dims[4], eps, scale};
  const cpu::StepInputs step{num_tokens, ptr<const int64_t>(positions),
                             ptr<const int64_t>(slot_mapping), ptr<const float>(cos_sin),
                             max_position, ptr<const int32_t>(query_start_loc),
                             ptr<const int32_t>(seq_lens), num_seqs,
                             ptr<const int32_t>(block_tables), table_stride, num_blocks,
                             block_size, kv_type(kv_cache_dtype)};
  cpu::decoder_layers(ptr<float>(residual), ptr<float>(out), layer_params(layers),
                      ptr<const float>(final_norm), shape, step, isa);
}

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lock(cpu::kernel_mutex());
  cpu::set_num_threads(n);
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.def("linear", &linear, py::arg("out"), py::arg("x"), py::arg("w"), py::arg("bias"),
        py::arg("qtype"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"),
        py::arg("out_stride"), py::arg("isa") = "auto", py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear", &int8_linear, py::arg("out"), py::arg("x"), py::arg("w"),
        py::arg("w_scale"), py::arg("input_scale"), py::arg("scale_divisor"), py::arg("bias"),
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("out_stride"),
        py::arg("isa") = "auto", py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, py::arg("out"), py::arg("w"), py::arg("qtype"),
        py::arg("num_rows"), py::arg("k"), py::arg("row_ids"), py::arg("num_ids"),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &decode_attention, py::arg("out"), py::arg("q"),
        py::arg("q_stride"), py::arg("kv_cache"), py::arg("num_blocks"), py::arg("block_size"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("num_heads"),
        py::arg("block_tables"), py::arg("table_stride"), py::arg("seq_lens"),
        py::arg("num_seqs"), py::arg("scale"), py::arg("kv_cache_dtype") = "float32",
        py::call_guard<py::gil_scoped_release>());
  m.def("to_float16", &to_float16, py::arg("out"), py::arg("x"), py::arg("n"),
        py::arg("isa") = "auto", py::call_guard<py::gil_scoped_release>());
  m.def("decoder_layers", &decoder_layers, py::arg("residual"), py::arg("out"),
        py::arg("layers"), py::arg("final_norm"), py::arg("dims"), py::arg("eps"),
        py::arg("scale"), py::arg("num_tokens"), py::arg("positions"), py::arg("slot_mapping"),
        py::arg("cos_sin_cache"), py::arg("max_position"), py::arg("query_start_loc"),
        py::arg("seq_lens"), py::arg("num_seqs"), py::arg("block_tables"),
        py::arg("table_stride"), py::arg("num_blocks"), py::arg("block_size"),
        py::arg("kv_cache_dtype") = "float32", py::arg("isa") = "auto",
        py::call_guard<py::gil_scoped_release>());
  m.def("set_num_threads", &set_num_threads, py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("num_threads", [] { return cpu::pool().num_threads(); });
  m.def("physical_cores", &cpu::physical_cores);
  m.def("best_isa", &cpu::best_isa);
  m.def("isa_name", [](const std::string& isa) { return std::string(cpu::select_kernels(isa).name); },
        py::arg("isa") = "auto");
}
