// The element-type codes of the launchers' `dtype` / `cache_dtype` arguments: the one table of
// them. bindings.cpp exports it as `tinyvllm._cuda.DType` under torch's dtype names, and
// ops/_dispatch.py `dtype_code` reads it from there. Framework-free (bindings.cpp includes it).
#pragma once

namespace tinyvllm {

enum DTypeCode : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3, kInt8 = 4 };

constexpr DTypeCode kAllDTypes[] = {kFloat32, kFloat16, kBFloat16, kFloat8E4M3, kInt8};

// torch's name of a code (`torch.<name>`); "unknown" for any other integer.
inline const char* dtype_name(int code) {
  switch (code) {
    case kFloat32: return "float32";
    case kFloat16: return "float16";
    case kBFloat16: return "bfloat16";
    case kFloat8E4M3: return "float8_e4m3fn";
    case kInt8: return "int8";
    default: return "unknown";
  }
}

}  // namespace tinyvllm
