"""Kernel benchmark: paged attention (decode, prefill), RMSNorm, SiLU-and-mul, GEMV, sampling
against torch.

    python -m tinyvllm.bench.kernels [--out bench-results/kernels.json] [--quick]

Follows BENCHMARKS.md: the device-to-device copy bandwidth is measured in the same run and every
memory-bound figure is reported as a fraction of it; every "faster" is a ratio against a torch
baseline timed in this process on the same inputs (SDPA on gathered contiguous K/V, the
gather-then-attend reference, eager torch for the elementwise ops). CUDA events, warm-up, medians;
decode (ours and SDPA) is timed as CUDA-graph replays, as the engine runs it.
A JSON record goes to --out; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from tinyvllm.ops.attention import AttentionMetadata, paged_attention_ref
from tinyvllm.ops.layers import rms_norm_ref, silu_and_mul_ref

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
ROTATE_BYTES = 512 << 20  # inputs smaller than this rotate through copies so L2 (50 MB) never holds them
TARGET_MS = 2.0           # each timed sample runs at least this long


@dataclass
class Row:
    name: str
    shape: str
    us: float
    gbps: Optional[float] = None
    tflops: Optional[float] = None
    frac_copy_bw: Optional[float] = None
    baselines_us: dict = field(default_factory=dict)  # name -> median us

    def ratios(self) -> dict:
        return {k: v / self.us for k, v in self.baselines_us.items()}


def time_us(fn: Callable[[int], None], reps: int = 15) -> float:
    """Median microseconds per call of fn(i) (i rotates inputs), events around batches of calls."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    end.record()
    end.synchronize()
    inner = max(1, min(200, int(TARGET_MS / max(start.elapsed_time(end), 1e-3))))
    samples = []
    for r in range(reps):
        start.record()
        for i in range(inner):
            fn(r * inner + i)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(samples)


def time_graph_us(fn: Callable[[int], None], calls: int = 20, reps: int = 15) -> float:
    """Median microseconds per call, fn(0..calls-1) captured in one CUDA graph and replayed.

    Removes the Python and launch overhead the engine also hides with graphs, so small shapes
    show the kernel's own time.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return time_us(lambda i: graph.replay(), reps) / calls


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB: (bytes read + bytes written) / time."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = time_us(lambda i: dst.copy_(src))
    return 2 * n / us / 1e3


# ---- paged attention --------------------------------------------------------------------------

def paged_batch(seqs, num_heads, num_kv_heads, head_dim, rotations, gen, fp8=False):
    """`rotations` metadata sets over one cache, each on its own blocks. seqs: (q_len, seq_len).
    fp8: the cache is FP8 E4M3 (scales 1.0)."""
    nb = [-(-s // BLOCK_SIZE) for _, s in seqs]
    num_blocks = 1 + rotations * sum(nb)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen,
                        device="cuda", dtype=DTYPE)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    perm = (torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1).int()
    q_lens, seq_lens = [q for q, _ in seqs], [s for _, s in seqs]
    cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    metas, used = [], 0
    for _ in range(rotations):
        tables = torch.zeros(len(seqs), max(nb), dtype=torch.int32, device="cuda")
        for i, n in enumerate(nb):
            tables[i, :n] = perm[used:used + n]
            used += n
        metas.append(AttentionMetadata(
            num_tokens=cu[-1], slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device="cuda"),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_tables=tables,
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=cu,
            seq_lens_cpu=seq_lens))
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen, device="cuda", dtype=DTYPE)
    return query, cache, metas


def bench_decode(kernels, batch, ctx, num_heads, num_kv_heads, head_dim, copy_gbps, gen,
                 fp8=False) -> Row:
    """fp8: an FP8 cache (half the K/V bytes); the SDPA baseline still reads bf16 K/V."""
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * (1 if fp8 else 2)
    rot = max(1, math.ceil(ROTATE_BYTES / kv_bytes))
    query, cache, metas = paged_batch([(1, ctx)] * batch, num_heads, num_kv_heads, head_dim, rot,
                                      gen, fp8)
    scale = head_dim ** -0.5
    us = time_graph_us(lambda i: paged_attention_cuda(kernels, query, cache, metas[i % rot],
                                                      scale))
    # Baseline 1: SDPA over K/V already gathered into contiguous [batch, h_kv, ctx, d].
    k = torch.randn(rot, batch, num_kv_heads, ctx, head_dim, generator=gen, device="cuda",
                    dtype=DTYPE)
    v = torch.randn_like(k)
    q = query.view(batch, num_heads, 1, head_dim)
    sdpa_us = time_graph_us(lambda i: F.scaled_dot_product_attention(
        q, k[i % rot], v[i % rot], scale=scale, enable_gqa=True))
    del k, v
    ref_us = time_us(lambda i: paged_attention_ref(query, cache, metas[i % rot], scale), reps=5)
    bytes_moved = kv_bytes + 2 * query.numel() * 2  # K/V once, q read, out written
    gbps = bytes_moved / us / 1e3
    return Row("decode fp8" if fp8 else "decode",
               f"b{batch} ctx{ctx} h{num_heads}/{num_kv_heads} d{head_dim}", us, gbps,
               frac_copy_bw=gbps / copy_gbps,
               baselines_us={"sdpa_contiguous": sdpa_us, "torch_ref": ref_us})


def bench_prefill(kernels, seqs, num_heads, num_kv_heads, head_dim, gen, fp8=False) -> Row:
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    query, cache, metas = paged_batch(seqs, num_heads, num_kv_heads, head_dim, 1, gen, fp8)
    scale = head_dim ** -0.5
    us = time_us(lambda i: paged_attention_cuda(kernels, query, cache, metas[0], scale))
    # Causal pairs: query at position p sees p + 1 keys. 2 matmuls x 2 flops per pair and dim.
    pairs = sum(sum(range(s - q + 1, s + 1)) for q, s in seqs)
    flops = 4 * pairs * num_heads * head_dim
    baselines = {"torch_ref": time_us(lambda i: paged_attention_ref(query, cache, metas[0], scale),
                                      reps=5)}
    if not fp8:  # on Hopper the default is the wgmma kernel: the mma.sync one beside it
        baselines["mma_sync"] = time_us(lambda i: paged_attention_cuda(
            kernels, query, cache, metas[0], scale, prefill_kernel="mma_sync"))
    if all(q == s for q, s in seqs) and len(set(s for _, s in seqs)) == 1:
        b, s = len(seqs), seqs[0][1]  # equal full prefills: SDPA causal on contiguous tensors
        q4 = query.view(b, s, num_heads, head_dim).transpose(1, 2)
        k4 = torch.randn(b, num_kv_heads, s, head_dim, generator=gen, device="cuda", dtype=DTYPE)
        v4 = torch.randn_like(k4)
        baselines["sdpa_contiguous"] = time_us(lambda i: F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True))
    shape = "+".join(f"{q}/{s}" for q, s in seqs[:2]) + (f" x{len(seqs)}" if len(seqs) > 2 else "")
    return Row("prefill fp8" if fp8 else "prefill",
               f"{shape} h{num_heads}/{num_kv_heads} d{head_dim}", us,
               tflops=flops / us / 1e6, baselines_us=baselines)


def bench_mixed(kernels, num_decodes, decode_ctx, prefills, num_heads, num_kv_heads, head_dim,
                gen) -> Row:
    """A mixed step's attention: decodes first, then prefill chunks; against the whole batch
    through the prefill kernel (the decode rows in prefill tiles)."""
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    seqs = [(1, decode_ctx)] * num_decodes + prefills
    query, cache, metas = paged_batch(seqs, num_heads, num_kv_heads, head_dim, 1, gen, False)
    scale = head_dim ** -0.5
    us = time_us(lambda i: paged_attention_cuda(kernels, query, cache, metas[0], scale))
    unsplit = time_us(lambda i: paged_attention_cuda(kernels, query, cache, metas[0], scale,
                                                     split_decodes=False))
    shape = (f"{num_decodes} x 1/{decode_ctx} + " + "+".join(f"{q}/{s}" for q, s in prefills[:1])
             + (f" x{len(prefills)}" if len(prefills) > 1 else ""))
    return Row("mixed", f"{shape} h{num_heads}/{num_kv_heads} d{head_dim}", us,
               baselines_us={"one_prefill_launch": unsplit})


# ---- elementwise ------------------------------------------------------------------------------

def bench_rms_norm(kernels, tokens, hidden, copy_gbps, gen) -> Row:
    from tinyvllm.ops.layers_cuda import rms_norm_cuda
    x = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=DTYPE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, generator=gen, device="cuda", dtype=DTYPE)
    out = torch.empty_like(x)
    us = time_us(lambda i: rms_norm_cuda(kernels, x, w, 1e-6, res, out=out))
    eager = time_us(lambda i: rms_norm_ref(x, w, 1e-6, res))
    gbps = 4 * x.numel() * 2 / us / 1e3  # read x, residual; write residual, out
    return Row("rms_norm+residual", f"{tokens}x{hidden}", us, gbps, frac_copy_bw=gbps / copy_gbps,
               baselines_us={"torch_eager": eager})


def bench_silu(kernels, tokens, d, copy_gbps, gen) -> Row:
    from tinyvllm.ops.layers_cuda import silu_and_mul_cuda
    x = torch.randn(tokens, 2 * d, generator=gen, device="cuda", dtype=DTYPE)
    out = torch.empty(tokens, d, device="cuda", dtype=DTYPE)
    us = time_us(lambda i: silu_and_mul_cuda(kernels, x, out=out))
    eager = time_us(lambda i: silu_and_mul_ref(x))
    gbps = 3 * tokens * d * 2 / us / 1e3
    return Row("silu_and_mul", f"{tokens}x{d}", us, gbps, frac_copy_bw=gbps / copy_gbps,
               baselines_us={"torch_eager": eager})


# ---- decode projections -----------------------------------------------------------------------

GEMV_SHAPES = {  # name: (n, k, prologue, epilogue) of each decoder projection at batch <= 8, as
    # LlamaDecoderLayer.forward_fused runs them (gate_up writes the SwiGLU product)
    "llama3-8b": [("qkv+norm", 6144, 4096, "rms_norm", None),
                  ("o+add", 4096, 4096, None, "residual"),
                  ("gate_up+norm+silu", 28672, 4096, "rms_norm", "silu_mul_out"),
                  ("down+add", 4096, 14336, None, "residual"),
                  ("down+silu+add", 4096, 14336, "silu_mul", "residual"),
                  ("lm_head", 128256, 4096, None, None)],
    "smollm2": [("qkv+norm", 960, 576, "rms_norm", None), ("o+add", 576, 576, None, "residual"),
                ("gate_up+norm+silu", 3072, 576, "rms_norm", "silu_mul_out"),
                ("down+add", 576, 1536, None, "residual"), ("lm_head", 49152, 576, None, None)],
}


def bench_gemv(model, name, m, n, k, prologue, epilogue, copy_gbps, gen,
               tensor_cores: bool = False) -> Row:
    """The fused GEMV against cuBLAS (F.linear alone, and with the unfused ops around it), all
    timed as CUDA-graph replays over weight copies that L2 cannot hold. tensor_cores: the
    tensor-core GEMV (cuda/gemv_mma.cuh) at any m, against the scalar one too where m <= 2."""
    from tinyvllm import ops
    from tinyvllm.config import KernelConfig
    from tinyvllm.ops.layers_cuda import rms_norm_cuda, silu_and_mul_cuda
    from tinyvllm.ops.linear import fused_linear
    kernels = cuda_ops_or_exit()
    weight_bytes = n * k * 2
    copies = max(1, -(-ROTATE_BYTES // weight_bytes))
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE) * k ** -0.5
               for _ in range(copies)]
    x = torch.randn(m, 2 * k if prologue == "silu_mul" else k, generator=gen, device="cuda",
                    dtype=DTYPE)
    norm_w = torch.randn(k, generator=gen, device="cuda", dtype=DTYPE)
    residual, swiglu = epilogue == "residual", epilogue == "silu_mul_out"
    res = torch.zeros(m, n, device="cuda", dtype=DTYPE) if residual else None
    out = torch.empty(m, n, device="cuda", dtype=DTYPE)
    out_half = torch.empty(m, n // 2, device="cuda", dtype=DTYPE)
    act = torch.empty(m, k, device="cuda", dtype=DTYPE)
    kwargs = dict(norm_weight=norm_w if prologue == "rms_norm" else None,
                  silu_mul=prologue == "silu_mul", silu_mul_out=swiglu)

    def ours(i):
        fused_linear(x, weights[i % copies], residual=res,
                     out=None if residual else out_half if swiglu else out, **kwargs)

    def cublas(i):
        torch.matmul(act, weights[i % copies].t(), out=out)

    def unfused(i):
        a = x
        if prologue == "rms_norm":
            a = rms_norm_cuda(kernels, x, norm_w, 1e-5, out=act)
        elif prologue == "silu_mul":
            a = silu_and_mul_cuda(kernels, x, out=act)
        torch.matmul(a, weights[i % copies].t(), out=out)
        if residual:
            res.add_(out)
        elif swiglu:
            silu_and_mul_cuda(kernels, out, out=out_half)

    baselines = {}
    if tensor_cores and m <= 2:
        baselines["scalar"] = time_graph_us(ours, calls=copies)
    ops.configure(KernelConfig(gemv_max_rows=0) if tensor_cores else KernelConfig())
    try:
        us = time_graph_us(ours, calls=copies)
    finally:
        ops.configure(KernelConfig())
    gbps = weight_bytes / us / 1e3
    baselines["cublas"] = time_graph_us(cublas, calls=copies)
    baselines["cublas+ops"] = time_graph_us(unfused, calls=copies)
    return Row(f"gemv{'-tc' if tensor_cores else ''} {model}", f"m{m} {name} {n}x{k}", us, gbps,
               frac_copy_bw=gbps / copy_gbps, baselines_us=baselines)


# ---- weight-only quantized linear ---------------------------------------------------------------

QUANT_SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                ("down", 4096, 14336)]
"""Llama-3-8B projections (n, k) for the W4A16 rows."""


def _int4pack_mm(q: torch.Tensor, group_size: int, copies: int, gen) -> Optional[Callable]:
    """torch._weight_int4pack_mm over the same 4-bit values (`copies` copies of the weight, call i
    reading copy i % copies, as ours do), or None where this torch lacks it."""
    n, k = q.shape
    try:
        packed = [torch._convert_weight_to_int4pack(
            (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8) for _ in range(copies)]
        sz = torch.rand(k // group_size, n, 2, generator=gen, device="cuda").to(DTYPE)
        x = torch.randn(1, k, generator=gen, device="cuda", dtype=DTYPE)
        torch._weight_int4pack_mm(x, packed[0], group_size, sz)
    except (RuntimeError, AttributeError, TypeError):
        return None
    return lambda x, i: torch._weight_int4pack_mm(x, packed[i % copies], group_size, sz)


def bench_quant_linear(m, name, n, k, bits, group_size, copy_gbps, gen) -> Row:
    """The W4A16 tile GEMV or GEMM (ops.quant_tiles, what a QuantLinear runs after load where
    they serve), else ops.quant_linear (the group layout: its GEMV up to 8 / 16 rows, dequantize
    + cuBLAS above), against cuBLAS over the bf16 weight, torch's int4 GEMM and the group layout's
    kernels, as CUDA-graph replays over weight copies L2 cannot hold."""
    from tinyvllm.ops import quant_linear as ql
    from tinyvllm.ops import quant_tiles as qt
    cuda_ops_or_exit()
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, device="cuda", dtype=torch.int32)
    packed_bytes = n * k * bits // 8 + 2 * 2 * n * (k // group_size)
    copies = max(1, -(-ROTATE_BYTES // packed_bytes))
    qweights = [ql.pack(q, bits) for _ in range(copies)]
    scales = (torch.rand(n, k // group_size, generator=gen, device="cuda") * 0.01).to(DTYPE)
    zeros = torch.full_like(scales, float(1 << (bits - 1)))
    bf16_copies = max(1, -(-ROTATE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE) * k ** -0.5
               for _ in range(bf16_copies)]
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=DTYPE)
    out = torch.empty(m, n, device="cuda", dtype=DTYPE)
    baselines = {"cublas_bf16": time_graph_us(
        lambda i: torch.matmul(x, weights[i % bf16_copies].t(), out=out), calls=bf16_copies)}
    if bits == 4:
        int4 = _int4pack_mm(q, group_size, copies, gen)
        if int4 is not None:
            baselines["torch_int4pack"] = time_graph_us(lambda i: int4(x, i), calls=copies)
    group_us = time_graph_us(lambda i: ql.quant_linear(x, qweights[i % copies], scales, zeros,
                                                       bits, group_size), calls=copies)
    tiles = ([qt.repack(w, scales, zeros, group_size) for w in qweights]
             if qt.tiles_supported(qweights[0], scales, zeros, bits, group_size) else None)
    if tiles is not None and (qt.gemv_serves(x, tiles[0]) or qt.gemm_serves(x, tiles[0])):
        # what QuantLinear runs after load: the GEMV, else the GEMM (against the tiles
        # dequantized for cuBLAS, which it replaces)
        baselines["group_layout"] = group_us
        if not qt.gemv_serves(x, tiles[0]):
            baselines["tile_dequant_cublas"] = time_graph_us(
                lambda i: torch.matmul(x, qt.dequantize_tiles_cuda(tiles[i % copies]).t(),
                                       out=out), calls=copies)
        if m <= 8:  # the other kernel of the group layout, to show the auto choice
            from tinyvllm.ops.quant_linear_cuda import quant_linear_cuda
            other = "simt" if m >= 3 else "mma"
            baselines[f"group_{other}"] = time_graph_us(
                lambda i: quant_linear_cuda(cuda_ops_or_exit(), x, qweights[i % copies], scales,
                                            zeros, bits, group_size, method=other), calls=copies)
        us = time_graph_us(lambda i: qt.tile_linear(x, tiles[i % copies]), calls=copies)
    else:
        us = group_us
    gbps = packed_bytes / us / 1e3
    return Row(f"w{bits}a16 g{group_size}", f"m{m} {name} {n}x{k}", us, gbps,
               frac_copy_bw=gbps / copy_gbps, baselines_us=baselines)


def bench_w8a8_gemm(m, name, n, k, qdtype, gen) -> Row:
    """A W8A8 projection's GEMM (ops.w8a8_linear.scaled_gemm over rows quantized beforehand, as
    the fused RMSNorm / SwiGLU hands them over; FP8 with the configured accumulation) against
    cuBLAS bf16 over the same shape, and FP8 with the other accumulation, as CUDA-graph
    replays; TFLOP/s of ours."""
    from tinyvllm import ops
    from tinyvllm.ops.w8a8_linear import QuantizedRows, scaled_gemm
    cuda_ops_or_exit()
    copies = max(1, -(-ROTATE_BYTES // (n * k)))
    w = torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5
    scale = w.abs().amax(1) / (448.0 if qdtype == torch.float8_e4m3fn else 127.0)
    q = (w / scale[:, None])
    q = q.to(qdtype) if qdtype == torch.float8_e4m3fn else q.round().to(torch.int8)
    qweights = [q.clone() for _ in range(copies)]
    bf16 = [w.to(DTYPE) for _ in range(max(1, -(-ROTATE_BYTES // (n * k * 2))))]
    x = torch.randn(m, k, generator=gen, device="cuda")
    xs = x.abs().amax(1, keepdim=True) / (448.0 if qdtype == torch.float8_e4m3fn else 127.0)
    xq = x / xs
    rows = QuantizedRows(xq.to(qdtype) if qdtype == torch.float8_e4m3fn
                         else xq.round().to(torch.int8), xs.float(), DTYPE)
    xb, out = x.to(DTYPE), torch.empty(m, n, device="cuda", dtype=DTYPE)

    def ours(i):
        scaled_gemm(rows, qweights[i % copies], scale)

    us = time_graph_us(ours, calls=copies)
    baselines = {"cublas_bf16": time_graph_us(
        lambda i: torch.matmul(xb, bf16[i % len(bf16)].t(), out=out), calls=len(bf16))}
    if qdtype == torch.float8_e4m3fn:
        config = ops.kernel_config()
        other = replace(config, fp8_fast_accum=not config.fp8_fast_accum)
        ops.configure(other)
        try:
            label = "fp8_fast_accum" if other.fp8_fast_accum else "fp8_promoted_accum"
            baselines[label] = time_graph_us(ours, calls=copies)
        finally:
            ops.configure(config)
    kind = "fp8" if qdtype == torch.float8_e4m3fn else "int8"
    return Row(f"w8a8 {kind} gemm", f"m{m} {name} {n}x{k}", us,
               tflops=2 * m * n * k / us / 1e6, baselines_us=baselines)


def _fused_inputs(m, n, k, prologue, epilogue, gen):
    """x, `fused_linear`'s keyword arguments and the residual (or None) of a fused projection row
    (GEMV_SHAPES' prologue and epilogue)."""
    x = torch.randn(m, 2 * k if prologue == "silu_mul" else k, generator=gen, device="cuda",
                    dtype=DTYPE)
    kwargs = dict(norm_weight=torch.randn(k, generator=gen, device="cuda", dtype=DTYPE)
                  if prologue == "rms_norm" else None, silu_mul=prologue == "silu_mul",
                  silu_mul_out=epilogue == "silu_mul_out")
    res = torch.zeros(m, n, device="cuda", dtype=DTYPE) if epilogue == "residual" else None
    return x, kwargs, res


def bench_tile_fused(m, name, n, k, prologue, epilogue, copy_gbps, gen) -> Row:
    """The W4A16 tile GEMV with a decoder layer's fusions (GEMV_SHAPES' names), group 128, as
    LlamaDecoderLayer.forward_fused runs it (gate_up interleaved, writing the SwiGLU product)."""
    from tinyvllm.ops import quant_linear as ql
    from tinyvllm.ops import quant_tiles as qt
    packed_bytes = n * k // 2 + 2 * 2 * n * (k // 128)
    copies = max(1, -(-ROTATE_BYTES // packed_bytes))
    q = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.int32)
    scales = (torch.rand(n, k // 128, generator=gen, device="cuda") * 0.01).to(DTYPE)
    zeros = torch.full_like(scales, 8.0)
    tiles = [qt.repack(ql.pack(q, 4), scales, zeros, 128, epilogue == "silu_mul_out")
             for _ in range(copies)]
    x, kwargs, res = _fused_inputs(m, n, k, prologue, epilogue, gen)
    us = time_graph_us(lambda i: qt.tile_linear(x, tiles[i % copies], residual=res, **kwargs),
                       calls=copies)
    gbps = packed_bytes / us / 1e3
    return Row("w4a16 g128 fused", f"m{m} {name} {n}x{k}", us, gbps, frac_copy_bw=gbps / copy_gbps)


def bench_gguf_linear(m, name, n, k, qtype_name, copy_gbps, gen) -> Row:
    """ops.quantized over GGUF blocks on the GPU (the GEMV up to 8 rows) against cuBLAS over the
    bf16 weight; random block bytes (timing only), weight copies L2 cannot hold."""
    from tinyvllm.ops import quantized as q
    cuda_ops_or_exit()
    qtype = q.PACKED_TYPES[qtype_name]
    row_bytes = q.row_bytes(qtype, k)
    packed_bytes = n * row_bytes
    copies = max(1, -(-ROTATE_BYTES // packed_bytes))
    qweights = [torch.randint(0, 256, (n, row_bytes), generator=gen, device="cuda",
                              dtype=torch.uint8) for _ in range(copies)]
    bf16_copies = max(1, -(-ROTATE_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE)
               for _ in range(bf16_copies)]
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=DTYPE)
    out = torch.empty(m, n, device="cuda", dtype=DTYPE)
    baselines = {"cublas_bf16": time_graph_us(
        lambda i: torch.matmul(x, weights[i % bf16_copies].t(), out=out), calls=bf16_copies)}
    us = time_graph_us(lambda i: q.quantized_linear(x, qweights[i % copies], qtype, k),
                       calls=copies)
    gbps = packed_bytes / us / 1e3
    return Row(f"gguf {qtype_name}", f"m{m} {name} {n}x{k}", us, gbps,
               frac_copy_bw=gbps / copy_gbps, baselines_us=baselines)


def bench_gguf_fused(m, model, name, n, k, prologue, epilogue, qtype_name, copy_gbps,
                     gen) -> Row:
    """The GGUF GEMV with a decoder layer's fusions (GEMV_SHAPES of `model`) against the same
    projection with the RMSNorm, SwiGLU product and residual add as their own launches
    (`unfused`); random block bytes, weight copies L2 cannot hold."""
    from tinyvllm.ops import quantized as q
    from tinyvllm.ops.linear import linear_unfused
    cuda_ops_or_exit()
    qtype = q.PACKED_TYPES[qtype_name]
    packed_bytes = n * q.row_bytes(qtype, k)
    copies = max(1, -(-ROTATE_BYTES // packed_bytes))
    qweights = [torch.randint(0, 256, (n, q.row_bytes(qtype, k)), generator=gen, device="cuda",
                              dtype=torch.uint8) for _ in range(copies)]
    x, kwargs, res = _fused_inputs(m, n, k, prologue, epilogue, gen)
    us = time_graph_us(lambda i: q.quantized_fused_linear(x, qweights[i % copies], qtype, k,
                                                          residual=res, **kwargs), calls=copies)
    unfused = time_graph_us(lambda i: linear_unfused(
        x, lambda a: q.quantized_linear(a, qweights[i % copies], qtype, k), residual=res,
        **kwargs), calls=copies)
    gbps = packed_bytes / us / 1e3
    return Row(f"gguf {qtype_name} fused", f"m{m} {model} {name} {n}x{k}", us, gbps,
               frac_copy_bw=gbps / copy_gbps, baselines_us={"unfused": unfused})


# ---- sampling ---------------------------------------------------------------------------------

SAMPLE_VOCAB = 128256  # llama3
SAMPLE_MODES = {  # name: (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "top_k50+top_p0.9": (0.8, 50, 0.9),
    "temperature": (0.8, 0, 1.0),
    "top_p0.9": (0.8, 0, 0.9),
}


def bench_sample(kernels, num_rows, mode, copy_gbps, gen) -> Row:
    """The sampling kernel (Philox noise) against the torch reference path (temperature, sort-based
    top-k/top-p, softmax, Exp(1) noise, race; greedy: torch argmax), both as CUDA-graph replays over
    logits copies that L2 cannot hold. Floor: one read of the logits at the copy bandwidth."""
    from tinyvllm.ops.sampling import sample_ref
    from tinyvllm.ops.sampling_cuda import sample_cuda
    logits_bytes = num_rows * SAMPLE_VOCAB * 4
    copies = max(1, -(-ROTATE_BYTES // logits_bytes))
    logits = [torch.randn(num_rows, SAMPLE_VOCAB, generator=gen, device="cuda") * 4
              for _ in range(copies)]
    t, k, p = SAMPLE_MODES[mode]
    temperature = torch.full((num_rows,), t, device="cuda")
    top_k = torch.full((num_rows,), k, dtype=torch.int64, device="cuda") if k else None
    top_p = torch.full((num_rows,), p, device="cuda") if p < 1 else None
    seed = torch.arange(num_rows, dtype=torch.int64, device="cuda")
    out = torch.empty(num_rows, dtype=torch.int64, device="cuda")

    def ours(i):
        sample_cuda(kernels, logits[i % copies], temperature, top_k, top_p, None, seed, seed, None,
                    out=out)

    def reference(i):
        if t == 0:
            return logits[i % copies].argmax(dim=-1)
        x = logits[i % copies].clone()
        return sample_ref(x, temperature, top_k, top_p, None, torch.empty_like(x).exponential_())

    us = time_graph_us(ours, calls=copies)
    gbps = logits_bytes / us / 1e3
    baseline = "torch_argmax" if t == 0 else "torch_ref"
    return Row("sample", f"{mode} r{num_rows} v{SAMPLE_VOCAB}", us, gbps,
               frac_copy_bw=gbps / copy_gbps,
               baselines_us={baseline: time_graph_us(reference, calls=min(copies, 64))})


# ---- CPU: the packed GGUF linear (tinyvllm._cpu) --------------------------------------------

CPU_SHAPES = [("down", 576, 1536), ("sq", 2048, 2048)]
"""(name, n, k) of the CPU rows (SmolLM2's down_proj, a square 2048): k a multiple of 256, so
every GGUF type runs."""


def time_cpu_us(fn: Callable[[], None], reps: int = 7) -> float:
    """Best of `reps` batches of calls (a batch ~50 ms), microseconds per call."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(0.05 / max(time.perf_counter() - start, 1e-6)))
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def bench_cpu_linear(type_name: str, m: int, name: str, n: int, k: int, isa: str) -> Row:
    """`quantized_linear` over packed GGUF rows on one thread (one ISA's kernels), against
    F.linear over the dequantized float32 weight on one thread; GB/s of packed weight read."""
    import gguf

    from tinyvllm.ops import quantized as q
    qtype = q.PACKED_TYPES[type_name]
    gen = torch.Generator().manual_seed(n + k)
    if qtype in q.KQUANT_TYPES.values():
        qweight = q.random_kquant_rows(n, k, qtype, seed=n + k)
    else:
        w = torch.randn(n, k, generator=gen).numpy()
        qweight = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
    weight = q.dequantize(qweight, qtype, k)
    x = torch.randn(m, k, generator=gen)
    us = time_cpu_us(lambda: q.quantized_linear(x, qweight, qtype, k, isa=isa))
    return Row(f"cpu {type_name}", f"{isa} m{m} {name} {n}x{k}", us,
               gbps=qweight.numel() / us / 1e3,
               baselines_us={"torch_f32": time_cpu_us(lambda: F.linear(x, weight))})


def cpu_name() -> str:
    """The CPU's model name (Linux's cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def cpu_rows(quick: bool) -> list[Row]:
    """Every GGUF type the CPU kernels read, on each ISA this CPU has, one thread each."""
    from tinyvllm.ops import quantized as q
    isas = [isa for isa in ("avx512vnni", "avx2", "scalar") if q.isa_available(isa)]
    types = list(q.PACKED_TYPES)
    torch_threads = torch.get_num_threads()
    q.set_num_threads(1)
    torch.set_num_threads(1)
    try:
        return [bench_cpu_linear(t, m, name, n, k, isa)
                for name, n, k in (CPU_SHAPES[:1] if quick else CPU_SHAPES)
                for m in ((1,) if quick else (1, 8)) for t in types for isa in isas]
    finally:
        q.set_num_threads(None)
        torch.set_num_threads(torch_threads)


def cuda_ops_or_exit():
    from tinyvllm.ops._dispatch import cuda_ops
    kernels = cuda_ops()
    if kernels is None:
        raise SystemExit("tinyvllm._cuda is not available (no GPU or module not built)")
    return kernels


# ---- driver -----------------------------------------------------------------------------------

def git_rev() -> str:
    if os.environ.get("TINYVLLM_GIT_REV"):
        return os.environ["TINYVLLM_GIT_REV"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(quick: bool, only: Optional[str] = None) -> tuple[float, list[Row]]:
    kernels = cuda_ops_or_exit()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    if only == "quant":
        return copy_gbps, quant_rows(quick, copy_gbps, gen)
    if only == "gemv":
        return copy_gbps, gemv_rows(quick, copy_gbps, gen)
    rows = []
    for batch in ([1, 64] if quick else [1, 8, 32, 64, 128]):
        rows.append(bench_decode(kernels, batch, 4096, 32, 8, 128, copy_gbps, gen))
    if not quick:
        rows.append(bench_decode(kernels, 64, 1024, 32, 8, 128, copy_gbps, gen))
        rows.append(bench_decode(kernels, 64, 4096, 9, 3, 64, copy_gbps, gen))
    for seqs in ([[(4096, 4096)]] if quick else
                 [[(4096, 4096)], [(2048, 2048)] * 4, [(512, 4096)] * 4, [(1024, 1024)] * 8]):
        rows.append(bench_prefill(kernels, seqs, 32, 8, 128, gen))
    rows.append(bench_mixed(kernels, 256, 1088, [(1024, 1024)] * 8, 32, 8, 128, gen))
    # FP8 KV cache: decode reads half the bytes; prefill dequantises tiles before the mma.
    for batch in ([1, 64] if quick else [1, 8, 64, 128]):
        rows.append(bench_decode(kernels, batch, 4096, 32, 8, 128, copy_gbps, gen, fp8=True))
    if not quick:
        rows.append(bench_decode(kernels, 64, 4096, 9, 3, 64, copy_gbps, gen, fp8=True))
    for seqs in ([[(2048, 2048)] * 4] if quick else [[(2048, 2048)] * 4, [(512, 4096)] * 4]):
        rows.append(bench_prefill(kernels, seqs, 32, 8, 128, gen, fp8=True))
    rows.append(bench_rms_norm(kernels, 4096, 4096, copy_gbps, gen))
    rows.append(bench_silu(kernels, 4096, 14336, copy_gbps, gen))
    rows += gemv_rows(quick, copy_gbps, gen)
    for mode in ("top_k50+top_p0.9", "greedy", "temperature"):
        for num_rows in ([1, 256] if quick else [1, 64, 256]):
            rows.append(bench_sample(kernels, num_rows, mode, copy_gbps, gen))
    return copy_gbps, rows + quant_rows(quick, copy_gbps, gen)


def gemv_rows(quick: bool, copy_gbps: float, gen) -> list[Row]:
    """The fused GEMVs at decode sizes: the scalar kernel at 1-2 rows, the tensor-core one at
    1-16 where it takes the shape (`ops.linear.tensor_cores_fit`)."""
    from tinyvllm.ops.linear import tensor_cores_fit
    rows = []
    for model, shapes in GEMV_SHAPES.items():
        for m in ([1] if quick else [1, 2]):
            for name, n, k, prologue, epilogue in shapes:
                rows.append(bench_gemv(model, name, m, n, k, prologue, epilogue, copy_gbps, gen))
        for m in ([1, 5] if quick else [1, 3, 5, 8, 16]):
            for name, n, k, prologue, epilogue in shapes:
                if tensor_cores_fit(m, n, k):
                    rows.append(bench_gemv(model, name, m, n, k, prologue, epilogue, copy_gbps,
                                           gen, tensor_cores=True))
    return rows


def quant_rows(quick: bool, copy_gbps: float, gen) -> list[Row]:
    rows = []
    for bits in ([4] if quick else [4, 8]):
        for m in ([1, 2, 4, 8, 16, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]):
            for name, n, k in QUANT_SHAPES:
                rows.append(bench_quant_linear(m, name, n, k, bits, 128, copy_gbps, gen))
    for m in ([1, 16] if quick else [1, 2, 4, 8, 16]):  # the decode batches the GEMV serves
        for name, n, k, prologue, epilogue in GEMV_SHAPES["llama3-8b"][:5]:
            rows.append(bench_tile_fused(m, name, n, k, prologue, epilogue, copy_gbps, gen))
    for qdtype in (torch.float8_e4m3fn, torch.int8):
        for m in ([2048] if quick else [16, 256, 2048, 8192, 16384]):
            for name, n, k in QUANT_SHAPES:
                rows.append(bench_w8a8_gemm(m, name, n, k, qdtype, gen))
    from tinyvllm.ops.quantized import PACKED_TYPES
    for qtype_name in PACKED_TYPES:
        for m in ([1] if quick else [1, 4, 8]):
            for name, n, k in QUANT_SHAPES:
                rows.append(bench_gguf_linear(m, name, n, k, qtype_name, copy_gbps, gen))
    for qtype_name in ("Q4_1", "Q8_0"):
        for m in ([1] if quick else [1, 2, 8]):
            for model in ("llama3-8b", "smollm2"):
                for name, n, k, prologue, epilogue in GEMV_SHAPES[model]:
                    if prologue != "silu_mul" and name != "lm_head":
                        rows.append(bench_gguf_fused(m, model, name, n, k, prologue, epilogue,
                                                     qtype_name, copy_gbps, gen))
    return rows


def print_table(copy_gbps: Optional[float], rows: list[Row]) -> None:
    if copy_gbps is not None:
        print(f"\ncopy bandwidth (d2d, read+write): {copy_gbps:.0f} GB/s")
    print(f"{'kernel':<18} {'shape':<32} {'us':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8}  "
          "ratios (baseline time / ours)")
    for r in rows:
        gbps = f"{r.gbps:.0f}" if r.gbps else "-"
        frac = f"{100 * r.frac_copy_bw:.0f}" if r.frac_copy_bw else "-"
        tfl = f"{r.tflops:.1f}" if r.tflops else "-"
        ratios = " ".join(f"{k}={v:.2f}x" for k, v in r.ratios().items())
        print(f"{r.name:<18} {r.shape:<32} {r.us:>9.1f} {gbps:>7} {frac:>6} {tfl:>8}  {ratios}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/kernels.json", help="JSON record path")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", choices=["quant", "gemv", "cpu"],
                        help="only these rows: quant (the GPU's quantized matmuls), gemv (the "
                        "fused float GEMVs, scalar and tensor-core, at decode sizes) or cpu (the "
                        "packed GGUF linear of tinyvllm._cpu, one thread, every ISA this CPU has, "
                        "against torch's float32 F.linear; needs no GPU)")
    args = parser.parse_args(argv)
    if args.only == "cpu":
        copy_gbps, rows, device = None, cpu_rows(args.quick), cpu_name()
    else:
        (copy_gbps, rows), device = run(args.quick, args.only), torch.cuda.get_device_name()
    record = {
        "benchmark": "kernels", "git_rev": git_rev(), "device": device,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "dtype": str(DTYPE).removeprefix("torch."), "block_size": BLOCK_SIZE,
        "copy_bandwidth_gbps": copy_gbps,
        "results": [dict(asdict(r), ratios=r.ratios()) for r in rows],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    print_table(copy_gbps, rows)


if __name__ == "__main__":
    main()
