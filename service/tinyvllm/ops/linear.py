"""Linear layers with what surrounds them in the decoder folded in (decode-sized batches).

`fused_linear` is one projection plus, optionally, the RMSNorm or SwiGLU that feeds it and the
residual add that consumes it:

    act = rmsnorm(x) * norm_weight      (norm_weight given: the norm before qkv_proj / gate_up_proj)
        | silu(x[:, :k]) * x[:, k:]     (silu_mul: SwiGLU before down_proj)
        | x
    y = act @ weight.T + bias
    residual += y  (in place, returned)  when residual is given,
    silu(y[:, :n/2]) * y[:, n/2:]        with silu_mul_out (gate_up_proj writing the SwiGLU
                                         product, so that down_proj needs no silu_mul prologue),
    else y

On CUDA with at most `KernelConfig.gemv_max_rows` rows of float16 / bfloat16 it is one launch of
the GEMV kernel (cuda/gemv.cuh), which streams the weight once; with more rows, up to
`KernelConfig.gemv_mma_max_rows`, one launch of its tensor-core form (cuda/gemv_mma.cuh: k a
multiple of 64, the rows' activations within its staging, n a multiple of 16 with
silu_mul_out), which also reads each weight once for all rows. `fused_linear_supported` says when
one applies, and `use_fused_decode` whether a decoder layer runs as such projections
(`KernelConfig.fused_gemv`). Under `KernelConfig.batch_invariant` every step, of any size, runs the
tensor-core form in chunks of 16, 8 or 4 rows (one launch; `INVARIANT_CHUNKS`), so that a row's
result does not depend on the rows beside it.
Elsewhere the torch reference runs: the unfused ops in the same order and with the same roundings.

x may also be a split decode's unmerged `DecodePartitions` (o_proj after
`rotary_paged_attention(..., merge=False)`): the GEMV merges them as its prologue, which takes the
place of the attention's merge launch; where the GEMV does not serve, they are merged first.

`prefetch_weight=True` (o_proj after decode attention) has the kernel request its whole weight
into L2 while the kernel before it still runs: attention leaves the memory bus idle for its ~10 us
of dependent latency, enough to bring in most of a Llama-3-8B o_proj (33.5 MB). Merging o_proj
always does this. It changes no value.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from tinyvllm.ops._dispatch import (cuda_ops, dtype_code, kernel_config, kernel_enabled,
                                    stream_handle)
from tinyvllm.ops.attention import DecodePartitions
from tinyvllm.ops.layers import rms_norm, rms_norm_ref, silu_and_mul, silu_and_mul_ref

_GEMV_STAGING_BYTES = 64 * 1024  # cuda/gemv.cu: the m x k activations staged per CTA
_MMA_STAGING_BYTES = 128 * 1024  # the tensor-core kernel's, m rounded up to 4, 8 or 16
_MMA_K_MULTIPLE, _MMA_BAND = 64, 16  # its tile of k and band of weight rows
_MMA_LAYER_MAX_K = 2048
"""Largest k of a decoder layer run on the tensor-core GEMV (`use_fused_decode`): at SmolLM2's
576 / 1536 its fused projections take 0.45-0.65x the time of cuBLAS and the separate ops at
3-8 rows, at Llama-3-8B's 4096 / 14336 about 1.05x (one band of 16 rows per CTA streams 64-224
tiles, and the bands divide unevenly over the SMs; `bench kernels --only gemv`, H100)."""
_PROLOGUE = {None: 0, "rms_norm": 1, "silu_mul": 2}
INVARIANT_CHUNKS = 2
"""`_gemv_kernel`'s (and `_cuda.gemv`'s `mma`) code for the tensor-core GEMV over any number of
rows in chunks (`KernelConfig.batch_invariant`); 0 is the scalar kernel, 1 the tensor-core one
over at most 16 rows."""


def use_fused_decode(x: torch.Tensor, *projections: torch.nn.Module) -> bool:
    """Whether a decoder layer over activations like x [num_tokens, hidden] runs these
    projections as `fused_linear` GEMV launches with the norms, SwiGLU and residual adds folded
    in: the engine's choice (`KernelConfig.fused_gemv`) where the kernel serves the batch and
    every projection is a plain weight or has a fused GEMV of its own that serves it
    (`fused_serves(x)` / `fused_linear(x, **kwargs)`: W4A16 tiles, model/quantization/layer.py;
    packed GGUF rows, model/packed.py). On the tensor-core GEMV only layers of k up to
    _MMA_LAYER_MAX_K take it, unless `KernelConfig.batch_invariant` asks for it wherever it
    serves (every batch on it, at 1-2 rows and prefill-sized ones too); packed projections do not
    under batch invariance."""
    if not kernel_config().fused_gemv or not x.is_cuda:
        return False
    for p in projections:
        weight = getattr(p, "weight", None)
        if (isinstance(weight, torch.Tensor) and weight.dim() == 2
                and weight.shape[-1] > _MMA_LAYER_MAX_K and not kernel_config().batch_invariant
                and _gemv_kernel(x.shape[0], x, weight) == 1):
            return False  # at Llama-3-8B's k the tensor-core layer trails cuBLAS + the ops
        serves = getattr(p, "fused_serves", None)  # a packed projection with its own GEMV
        if serves is not None:
            # Its GEMV's rows are not computed as under batch invariance (larger batches go to
            # cuBLAS): only 16-bit weights qualify then.
            if kernel_config().batch_invariant or not serves(x):
                return False
        elif not (isinstance(getattr(p, "weight", None), torch.Tensor)
                  and fused_linear_supported(x, p.weight)):
            return False
    return True


def fused_linear_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `fused_linear` runs as the GEMV kernel for activations like x and these weights."""
    return all(_gemv_kernel(x.shape[0], x, w) is not None for w in weights)


def _gemv_kernel(m: int, x: torch.Tensor | DecodePartitions,
                 weight: torch.Tensor) -> Optional[int]:
    """Which GEMV serves m rows like x (activations or partitions, for their dtype and device)
    with this weight [n, k]: 0 the scalar kernel, 1 the tensor-core one, None neither."""
    # Partitions only come from the CUDA decode kernel.
    on_cuda = isinstance(x, DecodePartitions) or x.is_cuda
    if (not on_cuda or x.dtype not in (torch.float16, torch.bfloat16)
            or not kernel_enabled("fused_linear")):
        return None
    if weight.dim() != 2 or not weight.is_contiguous():
        return None
    config, (n, k) = kernel_config(), weight.shape
    if config.batch_invariant:
        # Any m: the tensor-core kernel in chunks of 16, 8 or 4 rows, whichever its staging holds
        # (`_cuda.gemv` mma 2), each row computed as it would be alone.
        return INVARIANT_CHUNKS if tensor_cores_fit(4, n, k) else None
    if m <= config.gemv_max_rows:
        return 0 if k % 8 == 0 and m * k * 2 <= _GEMV_STAGING_BYTES else None
    if m <= config.gemv_mma_max_rows and tensor_cores_fit(m, n, k):
        return 1
    return None


def tensor_cores_fit(m: int, n: int, k: int) -> bool:
    """Whether the tensor-core GEMV takes m rows against a [n, k] weight: k in its tiles, n in
    its bands, and m rounded up to 4, 8 or 16 rows of k 16-bit values within its staging."""
    staged = 4 if m <= 4 else 8 if m <= 8 else 16
    return (k % _MMA_K_MULTIPLE == 0 and n % _MMA_BAND == 0
            and staged * k * 2 <= _MMA_STAGING_BYTES)


def fused_linear(x: torch.Tensor | DecodePartitions, weight: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, *,
                 norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 silu_mul: bool = False, residual: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, silu_mul_out: bool = False,
                 prefetch_weight: bool = False) -> torch.Tensor:
    """One projection with its prologue and epilogue (see the module docstring).

    Shape:
        x: [m, k], or [m, 2k] with silu_mul (gate | up); rows contiguous; or DecodePartitions of
            m sequences with num_heads * head_dim = k
        weight: [n, k] contiguous; bias: [n]; norm_weight: [k]; residual: [m, n]
    Returns: [m, n] ([m, n / 2] with silu_mul_out): `residual` itself (updated) when given, else
    `out` (an optional buffer of that shape with contiguous rows) or a new tensor.
    """
    if norm_weight is not None and silu_mul:
        raise ValueError("fused_linear: norm_weight and silu_mul exclude each other")
    if silu_mul_out and (silu_mul or residual is not None or weight.shape[0] % 2):
        raise ValueError(f"fused_linear: silu_mul_out needs an even number of weight rows, got "
                         f"{weight.shape[0]}, and neither silu_mul nor a residual")
    if isinstance(x, DecodePartitions):
        kernel = _merge_kernel(x, weight)
        if norm_weight is None and not silu_mul and not silu_mul_out and kernel is not None:
            return _merged_linear_cuda(x, weight, bias, residual, out, kernel)
        x = x.merge().flatten(1)
    kernel = _gemv_kernel(x.shape[0], x, weight)
    if kernel is not None:
        return _fused_linear_cuda(x, weight, bias, norm_weight, eps, silu_mul, residual, out,
                                  silu_mul_out, prefetch_weight, kernel)
    y = fused_linear_ref(x, weight, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                         residual=residual, silu_mul_out=silu_mul_out)
    return y if out is None or residual is not None else out.copy_(y)


def fused_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     *, norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                     silu_mul: bool = False, residual: Optional[torch.Tensor] = None,
                     silu_mul_out: bool = False) -> torch.Tensor:
    return linear_unfused(x, lambda a: F.linear(a, weight, bias), norm_weight=norm_weight,
                          eps=eps, silu_mul=silu_mul, residual=residual,
                          silu_mul_out=silu_mul_out, reference=True)


def linear_unfused(x: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor], *,
                   norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                   silu_mul: bool = False, residual: Optional[torch.Tensor] = None,
                   silu_mul_out: bool = False, reference: bool = False) -> torch.Tensor:
    """`fused_linear`'s result from separate ops around `linear` ([m, k] -> [m, n]): the norm or
    SwiGLU first, the SwiGLU product or the residual add after, each rounded to x's dtype as
    the fused kernels round. The ops are the torch references with `reference`, else the
    kernels where they serve (a packed projection's fusions where its GEMV does not take them)."""
    norm, act = (rms_norm_ref, silu_and_mul_ref) if reference else (rms_norm, silu_and_mul)
    if norm_weight is not None:
        x = norm(x, norm_weight, eps)
    elif silu_mul:
        x = act(x)
    y = linear(x)
    if silu_mul_out:
        return act(y)
    if residual is None:
        return y
    residual.copy_(residual + y)
    return residual


def _fused_linear_cuda(x, weight, bias, norm_weight, eps, silu_mul, residual, out,
                       silu_mul_out, prefetch_weight, mma) -> torch.Tensor:
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    want_cols = 2 * k if silu_mul else k
    if x.dim() != 2 or x.shape[1] != want_cols or (m and not x[0].is_contiguous()):
        raise ValueError(f"x: expected [m, {want_cols}] with contiguous rows for weight "
                         f"{tuple(weight.shape)}{' and silu_mul' if silu_mul else ''}, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    _check_params(x.dtype, x.device, n, k, weight=weight, bias=bias, norm_weight=norm_weight)
    n_out = n // 2 if silu_mul_out else n
    out = _output(m, n_out, x.dtype, x.device, residual, out)
    out_stride = out.stride(0) if m > 1 else n_out
    cuda_ops().gemv(
        out=out.data_ptr(), x=x.data_ptr(), weight=weight.data_ptr(), bias=_ptr(bias),
        residual=_ptr(residual), norm_weight=_ptr(norm_weight), m=m, n=n, k=k,
        x_stride=x.stride(0) if m > 1 else want_cols, out_stride=out_stride,
        residual_stride=out_stride, eps=eps,
        prologue=_PROLOGUE["rms_norm" if norm_weight is not None
                           else "silu_mul" if silu_mul else None],
        silu_mul_out=int(silu_mul_out), prefetch_weight=int(prefetch_weight), mma=mma,
        dtype=dtype_code(x.dtype), stream=stream_handle(x.device))
    return out


_MERGE_BYTES_PER_CTA = 64 * 1024
"""Partitions a GEMV CTA may read to merge them itself: every CTA merges all of them, so large
ones (many heads and splits: 8B-sized models; a verification step's rows over a long context
tier) cost more than the merge launch they replace."""


def _merge_kernel(parts: DecodePartitions, weight: torch.Tensor) -> Optional[int]:
    """`_gemv_kernel` for a GEMV that merges these partitions as its prologue (None: merge
    first)."""
    m, heads, splits, head_dim = parts.out.shape
    k = heads * head_dim
    if m * k * splits * 4 > _MERGE_BYTES_PER_CTA or weight.dim() != 2 or weight.shape[1] != k:
        return None
    kernel = _gemv_kernel(m, parts, weight)
    return None if kernel == INVARIANT_CHUNKS else kernel


def _merged_linear_cuda(parts: DecodePartitions, weight, bias, residual, out,
                        mma) -> torch.Tensor:
    m, heads, splits, head_dim = parts.out.shape
    n, k = weight.shape
    device = parts.out.device
    _check_params(parts.dtype, device, n, k, weight=weight, bias=bias)
    out = _output(m, n, parts.dtype, device, residual, out)
    out_stride = out.stride(0) if m > 1 else n
    cuda_ops().gemv_merge(
        out=out.data_ptr(), split_out=parts.out.data_ptr(), split_max=parts.max.data_ptr(),
        split_sum=parts.sum.data_ptr(), seq_lens=parts.seq_lens.data_ptr(),
        weight=weight.data_ptr(), bias=_ptr(bias), residual=_ptr(residual), m=m, n=n,
        num_heads=heads, head_dim=head_dim, num_splits=splits,
        partition_size=parts.partition_size, out_stride=out_stride,
        residual_stride=out_stride, mma=mma, dtype=dtype_code(parts.dtype),
        stream=stream_handle(device))
    return out


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _check_params(dtype: torch.dtype, device: torch.device, n: int, k: int,
                  **tensors: Optional[torch.Tensor]) -> None:
    """weight [n, k], bias [n] and norm_weight [k]: contiguous, of the activations' dtype."""
    shapes = {"weight": (n, k), "bias": (n,), "norm_weight": (k,)}
    for name, t in tensors.items():
        if t is not None and (tuple(t.shape) != shapes[name] or t.dtype != dtype
                              or not t.is_contiguous() or t.device != device):
            raise ValueError(f"{name}: expected a contiguous {dtype} {shapes[name]} tensor on "
                             f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _output(m: int, n: int, dtype: torch.dtype, device: torch.device,
            residual: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> torch.Tensor:
    """Where the kernel writes: residual (updated in place), else `out`, else a new tensor."""
    if residual is not None:
        if (tuple(residual.shape) != (m, n) or residual.dtype != dtype
                or residual.stride(-1) != 1 or residual.device != device):
            raise ValueError(f"residual: expected {dtype} ({m}, {n}) with contiguous rows, got "
                             f"{residual.dtype} {tuple(residual.shape)}")
        return residual
    if out is None:
        return torch.empty((m, n), dtype=dtype, device=device)
    if (tuple(out.shape) != (m, n) or out.dtype != dtype or out.stride(-1) != 1
            or out.device != device):
        raise ValueError(f"out: expected {dtype} ({m}, {n}) with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out
