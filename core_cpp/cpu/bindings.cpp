// The pybind11 module tinyvllm._cpu: declarations only. Pointers arrive as integers (the ops layer
// passes tensor.data_ptr()); sizes are checked in linear.cpp. The GIL is released while a kernel
// runs. Docstrings live in service/tinyvllm/_cpu.pyi.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>

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
  m.def("set_num_threads", &set_num_threads, py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("num_threads", [] { return cpu::pool().num_threads(); });
  m.def("physical_cores", &cpu::physical_cores);
  m.def("best_isa", &cpu::best_isa);
  m.def("isa_name", [](const std::string& isa) { return std::string(cpu::select_kernels(isa).name); },
        py::arg("isa") = "auto");
}
