// The pybind11 module tinyvllm._cpu: declarations only. Pointers arrive as integers (the ops layer
// passes tensor.data_ptr()); sizes are checked in linear.cpp. The GIL is released while a kernel
// runs. Docstrings live in service/tinyvllm/_cpu.pyi.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>

#include "attention.h"
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

void dequantize_rows(uintptr_t out, uintptr_t w, int qtype, int64_t num_rows, int64_t k,
                     uintptr_t row_ids, int64_t num_ids) {
  cpu::dequantize_rows(ptr<const uint8_t>(w), qtype, num_rows, k, ptr<const int64_t>(row_ids),
                       num_ids, ptr<float>(out));
}

void decode_attention(uintptr_t out, uintptr_t q, int64_t q_stride, uintptr_t cache,
                      int64_t num_blocks, int64_t block_size, int64_t hkv, int64_t d, int64_t h,
                      uintptr_t block_tables, int64_t table_stride, uintptr_t seq_lens, int64_t b,
                      float scale) {
  cpu::paged_decode_attention(ptr<float>(out), ptr<const float>(q), q_stride,
                              ptr<const float>(cache), num_blocks, block_size, hkv, d, h,
                              ptr<const int32_t>(block_tables), table_stride,
                              ptr<const int32_t>(seq_lens), b, scale);
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
  m.def("dequantize_rows", &dequantize_rows, py::arg("out"), py::arg("w"), py::arg("qtype"),
        py::arg("num_rows"), py::arg("k"), py::arg("row_ids"), py::arg("num_ids"),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &decode_attention, py::arg("out"), py::arg("q"),
        py::arg("q_stride"), py::arg("kv_cache"), py::arg("num_blocks"), py::arg("block_size"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("num_heads"),
        py::arg("block_tables"), py::arg("table_stride"), py::arg("seq_lens"),
        py::arg("num_seqs"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("set_num_threads", &set_num_threads, py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("num_threads", [] { return cpu::pool().num_threads(); });
  m.def("physical_cores", &cpu::physical_cores);
  m.def("best_isa", &cpu::best_isa);
  m.def("isa_name", [](const std::string& isa) { return std::string(cpu::select_kernels(isa).name); },
        py::arg("isa") = "auto");
}
