// pybind11 conversion of BlockHash <-> Python bytes of exactly 16 bytes.
//
// Reading the bytes buffer directly avoids a std::string per hash on lists of hundreds of hashes.
// A bytes object of the wrong length raises ValueError (a wrong *type* stays a TypeError).
#pragma once

#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "block_hash.h"

namespace pybind11 {
namespace detail {

template <>
struct type_caster<tinyvllm::BlockHash> {
  PYBIND11_TYPE_CASTER(tinyvllm::BlockHash, const_name("bytes"));

  bool load(handle src, bool /*convert*/) {
    if (!src || !PyBytes_Check(src.ptr())) return false;
    const Py_ssize_t num_bytes = PyBytes_GET_SIZE(src.ptr());
    if (num_bytes != static_cast<Py_ssize_t>(tinyvllm::kBlockHashBytes)) {
      throw value_error("a block hash must be " + std::to_string(tinyvllm::kBlockHashBytes) +
                        " bytes, got " + std::to_string(num_bytes));
    }
    std::memcpy(value.bytes.data(), PyBytes_AS_STRING(src.ptr()), tinyvllm::kBlockHashBytes);
    return true;
  }

  static handle cast(const tinyvllm::BlockHash& src, return_value_policy, handle) {
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(src.bytes.data()),
                                     static_cast<Py_ssize_t>(src.bytes.size()));
  }
};

}  // namespace detail
}  // namespace pybind11
