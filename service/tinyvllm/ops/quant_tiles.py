"""W4A16 weights in the tile layout of the tensor-core decode GEMV (cuda/quant_tiles.cuh), made
once at load from `ops.quant_linear`'s integer-group layout where the zero points are integers:

    tiles        int32 [bands, k / 64, 32, 4]   band b: 16 weight rows (rows 16b .. 16b + 15, or,
                                                interleaved, gate rows 8b .. 8b + 7 and up rows
                                                n / 2 + 8b ..); per 64 values of k, lane
                                                (g, t) = (l / 4, l % 4) holds in word j the 4-bit
                                                values of rows g and g + 8 at k0 + 16j + 4t + e
                                                (e = 0..3): row g in nibbles 0, 4, 2, 6, row g + 8
                                                in nibbles 1, 5, 3, 7, which is the order of the
                                                mma.m16n8k16 A fragments after one mask each
    tile_scales  [bands, k / group, 8, 2, 2]    the scales' dtype: (scale, magic + zero) of rows
                                                g and g + 8 per group (so a lane reads its two
                                                rows' in one 8-byte load); magic = 128 (bf16) /
                                                1024 (fp16); group_size a multiple of 64

Rows past n (n not a multiple of 16) are zero. `dequantize_tiles` is the torch inverse (equal to
`quant_linear.dequantize` of the source); `tile_linear` runs a projection over the layout, with
`ops.fused_linear`'s prologues and epilogues: the GEMV kernel where it serves (up to 16 rows a
launch), the GEMM kernel (`tile_gemm`) for larger batches up to GEMM_MAX_ROWS (WGMMA_MAX_ROWS
where the Hopper kernel runs), else the weight dequantized for cuBLAS; the fused ops the GEMV
does not take run as their own kernels around the GEMM, and as the torch reference around the
dequantized weight.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional

import torch

from tinyvllm.ops._dispatch import (cuda_ops, dtype_code, kernel_enabled, runs_sm90a_code,
                                    sm_count, stream_handle)
from tinyvllm.ops.layers import silu_and_mul
from tinyvllm.ops.linear import fused_linear_ref, linear_unfused
from tinyvllm.ops.quant_linear import unpack

TILE_K, TILE_ROWS = 64, 16
MAX_LAUNCHES = 2
"""GEMV launches over the same weight (slices of x's rows) before the GEMM serves the rest: two
reads of 4-bit weights cost less than the mma.sync GEMM's one."""
HOPPER_GEMV_LAUNCHES = 1
"""The same where the Hopper (wgmma) GEMM runs: past one launch it is the faster, though it runs
the layer unfused (a Llama-3-8B layer on an H200: two GEMV launches of 16 rows about 167 us, the
GEMM 117 us at 48 rows; the engine at batch 32 with gptq weights 1.48x; cuda/NOTES.md)."""
GEMM_MAX_ROWS = 128
"""Rows of x up to which the mma.sync GEMM kernel runs where the GEMV does not; above, the
weight is dequantized for cuBLAS (compute-bound there: cuBLAS's GEMM is the faster one)."""
WGMMA_MAX_ROWS = 256
"""The same limit for the Hopper (wgmma) GEMM kernel, where the sm_90a code runs."""
_GEMM_BLOCK_ROWS = (32, 64, 128)
_MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}
_NIBBLE = (0, 4, 2, 6)  # nibble of value e = 0..3 of a lane's four in a word (row g; +1: row g + 8)
_PROLOGUE = {None: 0, "rms_norm": 1, "silu_mul": 2}
SPLIT_SUMS, SPLIT_COUNTS = 1 << 21, 1 << 16
"""The per-device scratch of launches that split k across CTAs (`split_workspace`): float32 sums
(8 MiB: ceil(n / 16) x splits x 256 of them a launch) and a uint32 count per band of 16 rows."""


class QuantTiles(NamedTuple):
    """A weight in the tile layout; n, k: the logical [n, k] weight."""
    tiles: torch.Tensor        # int32 [bands, k / 64, 32, 4]
    tile_scales: torch.Tensor  # [bands, k / group_size, 8, 2, 2] (the activations' dtype)
    n: int
    k: int
    group_size: int
    interleaved: bool


def tiles_supported(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                    group_size: int) -> bool:
    """Whether `repack` takes this weight: 4 bits, float16 / bfloat16 scales, group_size k or a
    power of two of at least 64 (a group holds whole tiles) dividing k, and zero points that are
    integers magic + zero keeps exact."""
    k = qweight.shape[1] * 8
    if bits != 4 or scales.dtype not in _MAGIC or group_size % TILE_K or k % group_size:
        return False
    if group_size != k and group_size & (group_size - 1):
        return False
    z = zeros.float()
    magic = _MAGIC[scales.dtype]
    return bool(((z == z.round()) & (z >= -magic) & (z < magic)).all())


def _band_rows(n: int, interleaved: bool, device) -> torch.Tensor:
    """[bands, 16] logical row of each band row (n: a padding row, reading zeros)."""
    bands = -(-n // TILE_ROWS)
    if interleaved:
        half = torch.arange(bands * 8, device=device).view(bands, 8)
        return torch.cat([half, half + n // 2], dim=1)
    rows = torch.arange(bands * TILE_ROWS, device=device).view(bands, TILE_ROWS)
    return rows.clamp(max=n)


def repack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
           interleave: bool = False) -> QuantTiles:
    """`quant_linear`'s 4-bit layout -> the tile layout (see `tiles_supported`). interleave: the
    weight is gate rows then up rows (n even, n / 2 a multiple of 8), for the GEMV that writes
    silu(gate) * up."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if interleave and n % TILE_ROWS:
        raise ValueError(f"interleave: n={n} must be a multiple of {TILE_ROWS}")
    rows = _band_rows(n, interleave, qweight.device)  # [bands, 16]
    bands = rows.shape[0]
    pad = torch.zeros(1, k, dtype=torch.int32, device=qweight.device)
    q = torch.cat([unpack(qweight, 4), pad])[rows]  # [bands, 16 (hi, g), k]
    q = q.view(bands, 2, 8, k // TILE_K, 4, 4, 4)  # (b, hi, g, tile, j, t, e)
    q = q.permute(0, 3, 2, 5, 4, 1, 6).to(torch.int64)  # (b, tile, g, t, j, hi, e)
    shifts = 4 * (torch.tensor(_NIBBLE, device=q.device).view(1, 4)
                  + torch.arange(2, device=q.device).view(2, 1))  # [hi, e]
    words = (q << shifts).sum(dim=(-2, -1))  # [bands, tiles, 8, 4, 4]
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    tiles = words.reshape(bands, k // TILE_K, 32, 4).contiguous()

    groups = k // group_size
    s = torch.cat([scales, scales.new_zeros(1, groups)])[rows]  # [bands, 16, groups]
    z = torch.cat([zeros, zeros.new_zeros(1, groups)])[rows] + _MAGIC[scales.dtype]
    sz = torch.stack([s, z.to(scales.dtype)], dim=-1)  # [bands, 16 (hi, g), groups, 2]
    tile_scales = sz.view(bands, 2, 8, groups, 2).permute(0, 3, 2, 1, 4).contiguous()
    return QuantTiles(tiles, tile_scales, n, k, group_size, interleave)


def dequantize_tiles(w: QuantTiles) -> torch.Tensor:
    """The weight [n, k] in the scales' dtype, logical row order (torch; the oracle of the CUDA
    dequantize)."""
    bands, groups = w.tiles.shape[0], w.k // w.group_size
    words = w.tiles.view(bands, w.k // TILE_K, 8, 4, 4).to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * (torch.tensor(_NIBBLE, device=words.device).view(1, 4)
                  + torch.arange(2, device=words.device).view(2, 1))
    q = (words[..., None, None] >> shifts) & 0xF  # (b, tile, g, t, j, hi, e)
    q = q.permute(0, 5, 2, 1, 4, 3, 6).reshape(bands, TILE_ROWS, w.k).float()
    sz = w.tile_scales.float().permute(0, 3, 2, 1, 4).reshape(bands, TILE_ROWS, groups, 2)
    zero = sz[..., 1] - _MAGIC[w.tile_scales.dtype]
    deq = (q.view(bands, TILE_ROWS, groups, w.group_size) - zero[..., None]) * sz[..., 0, None]
    deq = deq.reshape(bands * TILE_ROWS, w.k).to(w.tile_scales.dtype)
    out = torch.empty(w.n, w.k, dtype=deq.dtype, device=deq.device)
    rows = _band_rows(w.n, w.interleaved, deq.device).reshape(-1)
    keep = rows < w.n
    out[rows[keep]] = deq[keep]
    return out


def dequantize_tiles_cuda(w: QuantTiles) -> torch.Tensor:
    out = torch.empty(w.n, w.k, dtype=w.tile_scales.dtype, device=w.tiles.device)
    cuda_ops().quant_tile_dequantize(
        out=out.data_ptr(), tiles=w.tiles.data_ptr(), tile_scales=w.tile_scales.data_ptr(),
        n=w.n, k=w.k, group_size=w.group_size, interleaved=int(w.interleaved),
        dtype=dtype_code(out.dtype), stream=stream_handle(out.device))
    return out


@functools.cache
def _rows_per_launch(k: int, rms_norm: bool, device: torch.device) -> int:
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return cuda_ops().quant_tile_rows(k=k, rms_norm=int(rms_norm))


def rows_per_launch(w: QuantTiles, rms_norm: bool = False) -> int:
    """Rows of x one GEMV launch serves over w on its GPU: 16, 8, 4, 2, 1 or 0, as the staged
    activations fit the device's shared memory per block, k split across CTAs where the whole
    of it does not (16 at Llama-3-8B's k = 4096 and 14336 on an H100). With the RMSNorm prologue
    (rms_norm) k is not split: 4 rows at k = 14336."""
    return _rows_per_launch(w.k, rms_norm, w.tiles.device)


@functools.cache
def split_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, counts): the scratch the GEMV adds split sums through on `device` (SPLIT_SUMS
    float32, SPLIT_COUNTS int32 zeros; each launch leaves the counts zero). Made when a weight
    is repacked (`QuantLinear.use_tiles`, at load), else by the first launch on the device: it
    must exist before a CUDA graph is captured, since zeros made during a capture are only
    written when the graph replays."""
    return (torch.empty(SPLIT_SUMS, dtype=torch.float32, device=device),
            torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device=device))


def _kernels_take(x: torch.Tensor, w: QuantTiles) -> bool:
    """Whether the tile kernels may run over x at all: on CUDA, in the scales' dtype, enabled."""
    return x.is_cuda and x.dtype == w.tile_scales.dtype and kernel_enabled("quant_linear")


def gemv_serves(x: torch.Tensor, w: QuantTiles, rms_norm: bool = False) -> bool:
    """Whether `tile_linear` over x [m, k] (or [m, 2k] with silu_mul) runs the GEMV kernel: at
    most MAX_LAUNCHES (HOPPER_GEMV_LAUNCHES where the wgmma GEMM runs) launches of
    `rows_per_launch` rows, each reading the whole weight."""
    if not _kernels_take(x, w):
        return False
    launches = HOPPER_GEMV_LAUNCHES if runs_sm90a_code(x.device) else MAX_LAUNCHES
    return 1 <= x.shape[0] <= launches * rows_per_launch(w, rms_norm)


def gemm_serves(x: torch.Tensor, w: QuantTiles) -> bool:
    """Whether `tile_linear` over x [m, k] runs the GEMM kernel where the GEMV does not."""
    if not _kernels_take(x, w):
        return False
    return 1 <= x.shape[0] <= (WGMMA_MAX_ROWS if runs_sm90a_code(x.device) else GEMM_MAX_ROWS)


def gemm_plan(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(rows of x a CTA, ways k is split, kernel) of a GEMM launch (`tile_gemm`'s arguments).

    Where the sm_90a code runs, above 16 rows: the wgmma kernel with 4 warpgroups (256 weight
    rows a CTA), 64 rows of x a CTA up to 64 and 128 above, and k split in the most of 1, 2, 4, 8
    ways that keeps the CTAs within one wave (and slices of at least 8 tiles of 64): the fastest
    or within 14% of the fastest of the block sizes, splits and warpgroups tried at
    Llama-3-8B's shapes and 64-256 rows on an H200 (cuda/NOTES.md). Else the mma.sync kernel:
    the smallest block that holds m rows (at most 128), and where the CTAs would not fill the
    device, k split into up to 8 slices of at least 8 tiles, about four CTAs an SM."""
    sms = sm_count(device)
    k_tiles = k // TILE_K
    if m > 16 and runs_sm90a_code(device):
        block = 64 if m <= 64 else 128
        ctas = -(-n // (TILE_ROWS * 16)) * -(-m // block)
        splits = 1
        while splits < 8 and ctas * splits * 2 <= sms and k_tiles // (splits * 2) >= 8:
            splits *= 2
        return block, splits, 4
    block = next((b for b in _GEMM_BLOCK_ROWS if b >= m), _GEMM_BLOCK_ROWS[-1])
    ctas = -(-n // (TILE_ROWS * 8)) * -(-m // block)
    splits = 1 if ctas >= sms else max(1, min(-(-4 * sms // ctas), k_tiles // 8, 8))
    return block, splits, 1


def tile_gemm(x: torch.Tensor, w: QuantTiles, bias: Optional[torch.Tensor] = None, *,
              block_rows: int = 0, splits: int = 0, kernel: int = 0) -> torch.Tensor:
    """x [m, k] . w^T (+ bias) -> [m, n] in x's dtype, by the tensor-core GEMM kernel over the
    tile layout (the weight dequantized in registers, exactly as `dequantize_tiles`).
    block_rows, splits, kernel: the launch's (0: `gemm_plan`'s); kernel 1 is the mma.sync
    kernel, 2 / 4 the Hopper (wgmma) kernel with that many warpgroups a CTA."""
    m = x.shape[0]
    if x.stride(-1) != 1 or (m > 1 and x.stride(0) % 8) or x.data_ptr() % 16:
        x = x.contiguous()
    plan = gemm_plan(m, w.n, w.k, x.device)
    if not kernel and 0 < block_rows < 64:
        kernel = 1  # the wgmma kernel takes blocks of 64 or 128 rows
    block_rows, splits, kernel = block_rows or plan[0], splits or plan[1], kernel or plan[2]
    out = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    partial = (torch.empty(splits, m, w.n, dtype=torch.float32, device=x.device)
               if splits > 1 else None)
    cuda_ops().quant_tile_gemm(
        out=out.data_ptr(), partial=0 if partial is None else partial.data_ptr(),
        x=x.data_ptr(), tiles=w.tiles.data_ptr(), tile_scales=w.tile_scales.data_ptr(),
        bias=0 if bias is None or partial is not None else bias.data_ptr(), m=m, n=w.n, k=w.k,
        x_stride=x.stride(0) if m > 1 else w.k, out_stride=w.n, group_size=w.group_size,
        interleaved=int(w.interleaved), block_rows=block_rows, splits=splits, kernel=kernel,
        dtype=dtype_code(x.dtype), stream=stream_handle(x.device))
    if partial is None:
        return out
    y = partial.sum(0)
    if bias is not None:
        y += bias.float()
    return out.copy_(y)


def tile_linear(x: torch.Tensor, w: QuantTiles, bias: Optional[torch.Tensor] = None, *,
                norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                silu_mul: bool = False, residual: Optional[torch.Tensor] = None,
                silu_mul_out: bool = False) -> torch.Tensor:
    """`ops.fused_linear` over a tile-layout weight (same arguments and results).

    Shape: x [m, k] ([m, 2k] with silu_mul), rows contiguous -> [m, n] ([m, n / 2] with
    silu_mul_out; `residual` itself, updated, when given).
    """
    if silu_mul_out and not w.interleaved:  # gate and up rows apart: the product afterwards
        return silu_and_mul(tile_linear(x, w, bias, norm_weight=norm_weight, eps=eps))
    if not gemv_serves(x, w, norm_weight is not None):
        if gemm_serves(x, w):
            return linear_unfused(x, lambda a: tile_gemm(a, w, bias), norm_weight=norm_weight,
                                  eps=eps, silu_mul=silu_mul, residual=residual,
                                  silu_mul_out=silu_mul_out)
        weight = (dequantize_tiles_cuda(w) if x.is_cuda and kernel_enabled("quant_linear")
                  else dequantize_tiles(w)).to(x.dtype)
        return fused_linear_ref(x, weight, bias, norm_weight=norm_weight, eps=eps,
                                silu_mul=silu_mul, residual=residual, silu_mul_out=silu_mul_out)
    m = x.shape[0]
    if x.stride(-1) != 1 or (m > 1 and x.stride(0) % 8) or x.data_ptr() % 16:
        x = x.contiguous()
    n_out = w.n // 2 if silu_mul_out else w.n
    out = residual if residual is not None else torch.empty(m, n_out, dtype=x.dtype,
                                                             device=x.device)
    rows = rows_per_launch(w, norm_weight is not None)
    for start in range(0, m, rows):
        _launch(x[start:start + rows], w, out[start:start + rows], bias, norm_weight, eps,
                silu_mul, residual is not None, silu_mul_out)
    return out


def _launch(x: torch.Tensor, w: QuantTiles, out: torch.Tensor, bias: Optional[torch.Tensor],
            norm_weight: Optional[torch.Tensor], eps: float, silu_mul: bool, residual: bool,
            silu_mul_out: bool, splits: int = 0) -> None:
    """One GEMV over x [m, k] into out [m, n] (out itself the residual when `residual`); splits:
    CTAs a band splits k across (0: the launcher's choice)."""
    m = x.shape[0]
    out_stride = out.stride(0) if m > 1 else out.shape[1]
    sums, counts = split_workspace(x.device)
    cuda_ops().quant_tile_gemv(
        out=out.data_ptr(), x=x.data_ptr(), tiles=w.tiles.data_ptr(),
        tile_scales=w.tile_scales.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
        residual=out.data_ptr() if residual else 0,
        norm_weight=0 if norm_weight is None else norm_weight.data_ptr(), m=m, n=w.n, k=w.k,
        x_stride=x.stride(0) if m > 1 else x.shape[1], out_stride=out_stride,
        residual_stride=out_stride, eps=eps, group_size=w.group_size,
        interleaved=int(w.interleaved),
        prologue=_PROLOGUE["rms_norm" if norm_weight is not None else
                           "silu_mul" if silu_mul else None],
        silu_mul_out=int(silu_mul_out), splits=splits, split_sums=sums.data_ptr(),
        split_sums_len=sums.numel(), split_counts=counts.data_ptr(),
        split_counts_len=counts.numel(), dtype=dtype_code(x.dtype),
        stream=stream_handle(x.device))
