"""Linear layers over GGUF weights kept packed (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K,
Q6_K).

    y = x @ dequantize(qweight).T + bias

`qweight` holds the file's bytes: one row per output feature, k / 32 blocks per row, each block
laid out as ggml writes it. The C++ kernels (`tinyvllm._cpu`, core_cpp/cpu/) quantize each row of
x to int8 per 32-value block on the fly (a float scale per block, round half to even) and take
integer dot products, as llama.cpp does. The K-quants (`KQUANT_TYPES`, 256-value super-blocks)
do the same per 256 values (llama.cpp's Q8_K: one float scale a super-block). The CUDA kernels
(`ops.gguf_cuda`) read every one of these types with float activations. Two torch references:

- `quantized_linear_ref`: the same arithmetic in torch (x through the same int8 round trip, per
  32 values, per 256 for the K-quants; the weight dequantized by `gguf.quants`); the kernels match
  it up to float summation order.
- `dequantized_linear_ref`: plain `F.linear` over the dequantized weight, the path the engine runs
  with `--dequantize`; the kernels differ from it by the activations' int8 rounding.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

QBLOCK = 32
"""Values per block of the int8-dot types (KERNEL_TYPES), and per activation block."""

QK_K = 256
"""Values per super-block of the K-quants (KQUANT_TYPES)."""

KERNEL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
"""GGUF 32-value types the kernels read (CPU, CUDA and the fused decoder step), by name -> ggml
type code (gguf.GGMLQuantizationType values)."""

KQUANT_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
"""GGUF K-quant types the kernels read (CPU: activations int8 per 256 values; CUDA: float)."""

BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 144, 13: 176, 14: 210}
"""Bytes per block (32 values; K-quants 256), by type code (ggml-common.h)."""

PACKED_TYPES = {**KERNEL_TYPES, **KQUANT_TYPES}
"""Every GGUF type kept packed (the CPU and the CUDA kernels read the same), by name -> code."""

_TYPE_NAMES = {code: name for name, code in PACKED_TYPES.items()}


def block_values(qtype: int) -> int:
    """Values per block of type code `qtype` (32, or 256 for the K-quants)."""
    return QK_K if qtype in KQUANT_TYPES.values() else QBLOCK

ISAS = ("auto", "avx512vnni", "avx2", "scalar")


@functools.cache
def cpu_kernels() -> Optional[ModuleType]:
    """The `tinyvllm._cpu` module, or None when it was not built (then the references run)."""
    if os.environ.get("TINYVLLM_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        from tinyvllm import _cpu
    except ImportError:
        return None
    return _cpu


def set_num_threads(num_threads: Optional[int]) -> int:
    """Size the kernels' thread pool (None or 0: physical cores); returns the size in use."""
    mod = cpu_kernels()
    if mod is None:
        return 0
    if num_threads is not None and num_threads < 0:
        raise ValueError(f"threads must be positive, got {num_threads}")
    mod.set_num_threads(num_threads or 0)
    return mod.num_threads()


def configure_cpu_threads(num_threads: Optional[int]) -> int:
    """Size the kernels' pool and torch's intra-op threads alike (None: physical cores), so that
    the two never ask for more cores than were given; returns the count."""
    count = num_threads or physical_cores()
    set_num_threads(count)
    torch.set_num_threads(count)
    return count


def physical_cores() -> int:
    mod = cpu_kernels()
    return mod.physical_cores() if mod is not None else (os.cpu_count() or 1)


def isa_available(isa: str) -> bool:
    """Whether this CPU and build run the kernels of `isa` (one of ISAS but auto)."""
    kernels = cpu_kernels()
    if kernels is None:
        return False
    try:
        kernels.isa_name(isa)
    except ValueError:
        return False
    return True


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one packed row of k values (k a multiple of block_values(qtype))."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype: expected one of {sorted(BLOCK_BYTES)} "
                         f"({', '.join(_TYPE_NAMES[c] for c in sorted(BLOCK_BYTES))}), got {qtype}")
    size = block_values(qtype)
    if k <= 0 or k % size:
        raise ValueError(f"k: expected a positive multiple of {size} for {_TYPE_NAMES[qtype]}, "
                         f"got {k}")
    return k // size * BLOCK_BYTES[qtype]


def _check_packed(qweight: torch.Tensor, qtype: int, k: int,
                  device: torch.device = torch.device("cpu")) -> None:
    want = row_bytes(qtype, k)
    if (qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != want
            or not qweight.is_contiguous() or qweight.device.type != device.type):
        raise ValueError(f"qweight: expected a contiguous {device.type.upper()} uint8 [n, {want}] tensor "
                         f"for k={k}, got {qweight.dtype} {tuple(qweight.shape)} on "
                         f"{qweight.device}")


def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, k: int,
                     bias: Optional[torch.Tensor] = None, *, isa: str = "auto") -> torch.Tensor:
    """x @ dequantize(qweight).T + bias through the C++ kernels (the reference without them).

    On a GPU (x and qweight there, x float16 / bfloat16) the CUDA GEMV reads the blocks with
    float activations (`ops.gguf_cuda`; without the kernels, the dequantized reference).

    Args:
        isa: "auto" (the best this CPU has; env TINYVLLM_CPU_ISA overrides), "avx512vnni",
            "avx2" or "scalar".
    Shape:
        x: [..., k] float32 on the CPU; qweight: [n, row_bytes(qtype, k)] uint8; bias: [n] float32
        returns: [..., n] float32
    """
    if x.is_cuda:
        return _quantized_linear_cuda(x, qweight, qtype, k, bias)
    _check_packed(qweight, qtype, k)
    n = qweight.shape[0]
    if x.dtype != torch.float32 or x.shape[-1] != k or x.device.type != "cpu":
        raise ValueError(f"x: expected a CPU float32 [..., {k}] tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias: expected a contiguous float32 ({n},) tensor, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {ISAS}, got {isa!r}")
    mod = cpu_kernels()
    if mod is None:
        return quantized_linear_ref(x, qweight, qtype, k, bias)
    x2 = x.reshape(-1, k)
    if x2.shape[0] and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)
    mod.linear(out.data_ptr(), x2.data_ptr(), qweight.data_ptr(),
               0 if bias is None else bias.data_ptr(), qtype, x2.shape[0], n, k,
               x2.stride(0) if x2.shape[0] > 1 else k, n, isa)
    return out.view(*x.shape[:-1], n)


def _quantized_linear_cuda(x: torch.Tensor, qweight: torch.Tensor, qtype: int, k: int,
                           bias: Optional[torch.Tensor]) -> torch.Tensor:
    from tinyvllm.ops._dispatch import use_kernel

    _check_packed(qweight, qtype, k, x.device)
    if x.dtype not in (torch.float16, torch.bfloat16) or x.shape[-1] != k:
        raise ValueError(f"x: expected a float16 / bfloat16 [..., {k}] tensor on the GPU, got "
                         f"{x.dtype} {tuple(x.shape)}")
    mod = use_kernel("gguf_linear", x, qweight)
    if mod is None:
        return dequantized_linear_ref(x, qweight, qtype, k, bias)
    from tinyvllm.ops.gguf_cuda import gguf_linear_cuda

    return gguf_linear_cuda(mod, x, qweight, qtype, k, bias)


def fused_gemv_serves(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether `quantized_fused_linear` over activations like x [m, ...] runs the CUDA GEMV with
    the fusions folded in (m <= 8 rows of float16 / bfloat16 on the GPU, with the kernels; the
    RMSNorm of many rows of a long k as a launch of its own, `gguf_cuda.stages_norm`)."""
    return _fused_gemv_kernel(x, qweight) is not None


def _fused_gemv_kernel(x: torch.Tensor, qweight: torch.Tensor):
    """The CUDA module where `fused_gemv_serves`, else None."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)):
        return None
    from tinyvllm.ops._dispatch import use_kernel
    from tinyvllm.ops.gguf_cuda import GEMV_MAX_ROWS

    return use_kernel("gguf_linear", x, qweight) if 0 < x.shape[0] <= GEMV_MAX_ROWS else None


def quantized_fused_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, k: int,
                           bias: Optional[torch.Tensor] = None, *,
                           norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                           silu_mul: bool = False, residual: Optional[torch.Tensor] = None,
                           silu_mul_out: bool = False) -> torch.Tensor:
    """`ops.fused_linear` over packed rows (same arguments and results; x [m, k], [m, 2k] with
    silu_mul): where `fused_gemv_serves`, the CUDA GEMV takes the RMSNorm, the residual add and
    the SwiGLU product (silu_mul, the SwiGLU before the projection, runs as its own op first);
    elsewhere, the CPU included, the same ops run apart around `quantized_linear`."""
    from tinyvllm.ops.linear import linear_unfused

    if norm_weight is not None and silu_mul:
        raise ValueError("quantized_fused_linear: norm_weight and silu_mul exclude each other")
    if silu_mul_out and (residual is not None or qweight.shape[0] % 2):
        raise ValueError(f"quantized_fused_linear: silu_mul_out needs an even number of weight "
                         f"rows, got {qweight.shape[0]}, and no residual")
    if silu_mul:
        from tinyvllm.ops.layers import silu_and_mul

        x = silu_and_mul(x)
    kernel = _fused_gemv_kernel(x, qweight)
    if kernel is not None:
        from tinyvllm.ops.gguf_cuda import gguf_linear_cuda

        _check_packed(qweight, qtype, k, x.device)
        return gguf_linear_cuda(kernel, x, qweight, qtype, k, bias, norm_weight=norm_weight,
                                eps=eps, residual=residual, silu_mul_out=silu_mul_out)
    return linear_unfused(x, lambda a: quantized_linear(a, qweight, qtype, k, bias),
                          norm_weight=norm_weight, eps=eps, residual=residual,
                          silu_mul_out=silu_mul_out)


def embedding_rows(qweight: torch.Tensor, qtype: int, k: int, ids: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` of a packed [num_rows, k] matrix (a quantized embedding lookup), float32 on the
    CPU; on a GPU in `dtype` (float16 / bfloat16) through the CUDA dequantize kernel.

    Shape: ids [...] int64 -> [..., k].
    """
    if qweight.is_cuda:
        from tinyvllm.ops._dispatch import use_kernel

        _check_packed(qweight, qtype, k, qweight.device)
        mod = use_kernel("gguf_linear", qweight)
        if mod is None:
            return dequantize(qweight[ids.reshape(-1)].cpu(), qtype, k).to(
                device=qweight.device, dtype=dtype).view(*ids.shape, k)
        from tinyvllm.ops.gguf_cuda import gguf_dequantize_cuda

        return gguf_dequantize_cuda(mod, qweight, qtype, k, dtype, ids.reshape(-1)).view(
            *ids.shape, k)
    _check_packed(qweight, qtype, k)
    mod = cpu_kernels()
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if mod is None:
        return dequantize(qweight[flat], qtype, k).view(*ids.shape, k)
    out = torch.empty((flat.shape[0], k), dtype=torch.float32)
    mod.dequantize_rows(out.data_ptr(), qweight.data_ptr(), qtype, qweight.shape[0], k,
                        flat.data_ptr(), flat.shape[0])
    return out.view(*ids.shape, k)


# --- references ---------------------------------------------------------------------------------

def dequantize(qweight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The packed rows as float32 [n, k] on qweight's device, through `gguf.quants` (the oracle
    for the layouts)."""
    import gguf

    if qweight.device.type != "cpu":
        return dequantize(qweight.cpu(), qtype, k).to(qweight.device)
    _check_packed(qweight, qtype, k)
    values = gguf.quants.dequantize(qweight.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, k))


_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of each K-quant block's fp16 scales (d, dmin; Q6_K's d is last), ggml-common.h."""


def random_kquant_rows(n: int, k: int, qtype: int, seed: int) -> torch.Tensor:
    """[n, row_bytes] random K-quant blocks (tests and `bench kernels --only cpu`; gguf-py cannot
    quantize to the K types): random bytes, the fp16 scales set to small positive halves (finite
    values of a sane size; random bytes there would give inf / nan)."""
    gen = np.random.default_rng(seed)
    rows = gen.integers(0, 256, (n * k // QK_K, BLOCK_BYTES[qtype]), dtype=np.uint8)
    # Q6_K's int8 sub-block scales reach 127 * 32 per step: a smaller d keeps values near 1.
    scale = 1e-4 if qtype == KQUANT_TYPES["Q6_K"] else 2e-3
    for offset in _K_SCALE_OFFSETS[_TYPE_NAMES[qtype]]:
        halves = gen.uniform(0.25, 1.0, rows.shape[0]).astype(np.float16) * np.float16(scale)
        rows[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(rows.reshape(n, -1))


def quantize_activations_ref(x: torch.Tensor, block: int = QBLOCK) -> torch.Tensor:
    """x after the kernels' int8 round trip: per `block` values (32; 256 for the K-quants)
    d = max|x| / 127, q = round(x / d) (x times 1 / d, half to even), back to q * d.
    Shape: [..., k] -> [..., k] float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    return (q * d).reshape(x.shape)


def quantized_linear_ref(x: torch.Tensor, qweight: torch.Tensor, qtype: int, k: int,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the kernels compute, in torch: int8-rounded x (per 32 values, per 256 for the
    K-quants) against the dequantized weight."""
    xq = quantize_activations_ref(x, block_values(qtype))
    return F.linear(xq, dequantize(qweight, qtype, k).to(x.device), bias)


def dequantized_linear_ref(x: torch.Tensor, qweight: torch.Tensor, qtype: int, k: int,
                           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The `--dequantize` path: F.linear over the dequantized weight, x as it is."""
    return F.linear(x, dequantize(qweight, qtype, k).to(device=x.device, dtype=x.dtype), bias)
