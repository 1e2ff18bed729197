// The pybind11 module tinyvllm._core: declarations only. The logic lives in block_pool.cpp,
// block_hasher.cpp and ngram.cpp; type conversions in py_casters.h. Docstrings live in service/tinyvllm/_core.pyi.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "block_hasher.h"
#include "block_pool.h"
#include "ngram.h"
#include "py_casters.h"

namespace py = pybind11;
using tinyvllm::BlockHash;
using tinyvllm::BlockHasher;
using tinyvllm::BlockPool;

namespace {

// Reference-vector hook for tests: SipHash-2-4-128 of data under a raw 16-byte key.
py::bytes siphash128_bytes(const std::string& key, const std::string& data) {
  if (key.size() != tinyvllm::kBlockHashBytes) {
    throw std::invalid_argument("siphash128 key must be 16 bytes, got " +
                                std::to_string(key.size()));
  }
  const auto* key_bytes = reinterpret_cast<const uint8_t*>(key.data());
  const BlockHash h = tinyvllm::siphash128(tinyvllm::sip_key_from_bytes(key_bytes),
                                           reinterpret_cast<const uint8_t*>(data.data()),
                                           data.size());
  return py::bytes(reinterpret_cast<const char*>(h.bytes.data()), h.bytes.size());
}

void declare_block_pool(py::module_& m) {
  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init<int, bool>(), py::arg("num_blocks"), py::arg("enable_caching") = true)
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free_blocks)
      .def_property_readonly("usage", &BlockPool::usage)
      .def_property_readonly("num_cached_blocks", &BlockPool::num_cached_blocks)
      .def_property_readonly("num_evictions", &BlockPool::num_evictions)
      .def("allocate", &BlockPool::allocate, py::arg("n"))
      .def("free", &BlockPool::free, py::arg("block_ids"))
      .def("touch", &BlockPool::touch, py::arg("block_ids"))
      .def("ref_count", &BlockPool::ref_count, py::arg("block_id"))
      .def("free_block_ids", &BlockPool::free_block_ids)
      .def("lookup", &BlockPool::lookup, py::arg("block_hashes"), py::arg("max_hit_blocks"))
      .def("cache_blocks", &BlockPool::cache_blocks, py::arg("block_ids"),
           py::arg("block_hashes"))
      .def("reset_prefix_cache", &BlockPool::reset_prefix_cache)
      .def("block_hash", &BlockPool::block_hash, py::arg("block_id"));
}

void declare_block_hasher(py::module_& m) {
  py::class_<BlockHasher>(m, "BlockHasher")
      .def(py::init<int, std::optional<uint64_t>>(), py::arg("block_size"),
           py::arg("seed") = py::none())
      .def_property_readonly("block_size", &BlockHasher::block_size)
      .def("hash_blocks", &BlockHasher::hash_blocks, py::arg("token_ids"),
           py::arg("parent_hash") = py::none(), py::arg("extra_key") = py::bytes(""));
}

std::vector<int64_t> ngram_propose_array(
    const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& token_ids, int min_n,
    int max_n, int k) {
  if (token_ids.ndim() != 1) {
    throw std::invalid_argument("ngram_propose: token_ids must be 1-D, got " +
                                std::to_string(token_ids.ndim()) + " dimensions");
  }
  if (min_n < 1 || max_n < min_n) {
    throw std::invalid_argument("ngram_propose: need 1 <= min_n <= max_n, got min_n=" +
                                std::to_string(min_n) + ", max_n=" + std::to_string(max_n));
  }
  return tinyvllm::ngram_propose(token_ids.data(), token_ids.shape(0), min_n, max_n, k);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "tinyvllm C++ core: KV block pool, prefix-cache table and block hashing.";
  declare_block_pool(m);
  declare_block_hasher(m);
  m.def("siphash128", &siphash128_bytes, py::arg("key"), py::arg("data"));
  m.def("ngram_propose", &ngram_propose_array, py::arg("token_ids"), py::arg("min_n"),
        py::arg("max_n"), py::arg("k"));
}
