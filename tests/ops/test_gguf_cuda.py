"""The GGUF block GEMV and dequantize kernels (cuda/gguf_gemv.cuh) against gguf-py's
dequantization (ops/quantized.py's references)."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from tinyvllm.ops import quantized as q
from tinyvllm.ops._dispatch import cuda_ops
from tinyvllm.ops.gguf_cuda import gguf_dequantize_cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

QTYPES = [2, 3, 8]  # Q4_0, Q4_1, Q8_0
K_QTYPES = [12, 13, 14]  # Q4_K, Q5_K, Q6_K


def packed(n, k, qtype, seed):
    """Blocks of a random weight: quantized by gguf-py, or random K-quant blocks (gguf-py does
    not quantize to the K types)."""
    if qtype in K_QTYPES:
        return q.random_kquant_rows(n, k, qtype, seed).cuda()
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(blocks)).cuda()


def rel_err(out, ref):
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


SHAPES = [(7, 32), (1001, 576), (576, 1536), (4104, 4096), (33, 14336), (16390, 96)]
"""4,104 and 16,390 rows: the 32-value GEMV's 4 rows a warp (from two rows of x, and at one row
from 16,384: cuda/gguf_gemv.cuh's gguf_wide_rows), the last warp partial; fewer rows take 2."""
K_SHAPES = [(7, 256), (1001, 768), (576, 1536), (4104, 4096), (33, 14336)]
"""Rows of 3 super-blocks (k = 768) leave every other Q6_K block (210 bytes) 2-byte aligned."""
CASES = ([(qt, m, n, k) for qt in QTYPES for m in (1, 2, 3, 8, 9, 33) for n, k in SHAPES]
         + [(qt, m, n, k) for qt in K_QTYPES for m in (1, 2, 3, 8, 9) for n, k in K_SHAPES])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype,m,n,k", CASES)
def test_gguf_linear_matches_dequantized_reference(dtype, qtype, m, n, k):
    """The GEMV up to 8 rows, the dequantize kernel and cuBLAS above, every type."""
    qweight = packed(n, k, qtype, seed=m * 31 + n + k)
    gen = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype) if n % 2 else None
    out = q.quantized_linear(x, qweight, qtype, k, bias)
    ref = q.dequantized_linear_ref(x.float(), qweight, qtype, k,
                                   None if bias is None else bias.float())
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < (3e-3 if dtype == torch.float16 else 1e-2)


FUSED_SHAPES = [(2002, 576), (96, 4096), (8194, 4096), (40, 1536)]
"""Gate / up halves of 1,001 rows (an odd last warp); k = 4,096 takes the RMSNorm in the GEMV
at 1 row and as its own op at 3 and 8 (gguf_cuda.stages_norm); 8,194 rows take 4 rows a warp
from 2 rows of x; the K-quants take the multiples of 256."""
FUSED_CASES = [(qt, m, n, k) for qt in QTYPES + K_QTYPES for m in (1, 3, 8)
               for n, k in FUSED_SHAPES if qt in QTYPES or k % 256 == 0]


@functools.lru_cache(maxsize=None)
def packed_once(n, k, qtype):
    """`packed` once per shape and type (gguf-py quantizes on the CPU)."""
    return packed(n, k, qtype, seed=n + k)


def fused_reference(x, qweight, qtype, k, bias, norm_weight, residual, silu_mul_out):
    """The unfused ops in float32 from x's dtype-rounded normalised rows (as the kernels round)."""
    from tinyvllm.ops.layers import rms_norm_ref, silu_and_mul_ref

    a = x if norm_weight is None else rms_norm_ref(x, norm_weight, 1e-5)
    y = q.dequantized_linear_ref(a.float(), qweight, qtype, k,
                                 None if bias is None else bias.float())
    if silu_mul_out:
        return silu_and_mul_ref(y.to(x.dtype).float())
    return y if residual is None else residual.float() + y.to(x.dtype).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fusion", ["rms_norm", "residual", "rms_norm+silu_mul_out"])
@pytest.mark.parametrize("qtype,m,n,k", FUSED_CASES)
def test_fused_gemv_matches_the_unfused_ops(dtype, fusion, qtype, m, n, k):
    """The GEMV with the decoder's fusions (one launch) against the ops apart: RMSNorm before
    (x staged per CTA), the residual add after (in place), the SwiGLU product of gate and up."""
    qweight = packed_once(n, k, qtype)
    gen = torch.Generator(device="cuda").manual_seed(n * m + k)
    x = (torch.randn(m, k, generator=gen, device="cuda") * 3).to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype) if qtype == 3 else None
    norm_weight = (torch.rand(k, generator=gen, device="cuda") + 0.5).to(dtype)
    kwargs = dict(norm_weight=norm_weight if "rms_norm" in fusion else None, eps=1e-5,
                  silu_mul_out="silu" in fusion)
    residual = None
    if fusion == "residual":
        residual = torch.randn(m, n, generator=gen, device="cuda").to(dtype)
        kwargs["residual"] = residual
    ref = fused_reference(x, qweight, qtype, k, bias, kwargs["norm_weight"],
                          None if residual is None else residual.clone(), kwargs["silu_mul_out"])
    assert q.fused_gemv_serves(x, qweight)
    out = q.quantized_fused_linear(x, qweight, qtype, k, bias, **kwargs)
    assert out.shape == (m, n // 2 if kwargs["silu_mul_out"] else n) and out.dtype == dtype
    if residual is not None:
        assert out is residual  # updated in place
    assert rel_err(out, ref) < (3e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.parametrize("qtype", [3, 13])
def test_the_kernel_stages_eight_normalised_rows_past_48_kb(qtype):
    """The RMSNorm prologue called directly at 8 rows of k = 4,096: 80 KB of staged x per CTA,
    past what a launch gets without opting in (the wrapper runs the norm apart there)."""
    from tinyvllm.ops.layers import rms_norm_ref

    n, k, m = 200, 4096, 8
    qweight = packed_once(n, k, qtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cuda_ops().gguf_gemv(**gemv_kwargs(out, x, qweight, m=m, n=n, k=k, qtype=qtype, prologue=1,
                                       norm_weight=norm_weight.data_ptr(), dtype=2))
    ref = q.dequantized_linear_ref(rms_norm_ref(x, norm_weight, 1e-5).float(), qweight, qtype, k)
    assert rel_err(out, ref) < 1e-2


def test_fused_gemv_writes_rows_of_a_wider_residual():
    """The residual stream as a slice with a row stride (the engine's [T, hidden] buffer)."""
    qtype, n, k, m = 3, 576, 1536, 5
    qweight = packed(n, k, qtype, seed=11)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wide = torch.randn(m, n + 64, device="cuda", dtype=torch.bfloat16)
    residual = wide[:, :n]
    before, right = residual.clone(), wide[:, n:].clone()
    q.quantized_fused_linear(x, qweight, qtype, k, residual=residual)
    ref = before.float() + q.dequantized_linear_ref(x.float(), qweight, qtype, k).bfloat16().float()
    assert rel_err(residual, ref) < 1e-2
    assert torch.equal(wide[:, n:], right)  # nothing written past the rows' n columns


def test_fused_gemv_falls_back_to_the_ops_above_eight_rows():
    qtype, n, k, m = 8, 64, 256, 12
    qweight = packed(n, k, qtype, seed=5)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    norm_weight = torch.ones(k, device="cuda", dtype=torch.float16)
    assert not q.fused_gemv_serves(x, qweight)
    out = q.quantized_fused_linear(x, qweight, qtype, k, norm_weight=norm_weight, eps=1e-5,
                                   silu_mul_out=True)
    ref = fused_reference(x, qweight, qtype, k, None, norm_weight, None, True)
    assert out.shape == (m, n // 2) and rel_err(out, ref) < 3e-3


def test_kquant_gemv_reads_strided_rows_of_x():
    """Rows of x a stride apart (a slice of a wider activation), as the engine hands over."""
    qtype, n, k, m = 13, 96, 512, 4
    qweight = packed(n, k, qtype, seed=3)
    wide = torch.randn(m, k + 64, device="cuda", dtype=torch.bfloat16)
    x = wide[:, 64:]
    out = q.quantized_linear(x, qweight, qtype, k)
    ref = q.dequantized_linear_ref(x.float(), qweight, qtype, k)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 4])
def test_chained_gemvs_in_a_graph_read_their_predecessor_s_output(qtype, m):
    """GEMVs feeding each other, captured as one graph and replayed: each reads the output of
    the one before, as the same chain run eagerly (checked against the reference) does."""
    k = 1024
    weights = [packed(k, k, qtype, seed=qtype * 10 + i) for i in range(6)]
    x = torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(m),
                    device="cuda").to(torch.bfloat16)

    def chain(v):
        for w in weights:
            v = q.quantized_linear(v, w, qtype, k)  # GEMV after GEMV, nothing between
        return v

    want = chain(x)
    ref = x.float()
    for w in weights:
        ref = q.dequantized_linear_ref(ref.to(torch.bfloat16).float(), w, qtype, k)
    assert rel_err(want, ref) < 5e-2
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static_x)  # warm-up off the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, want)


@pytest.mark.parametrize("qtype", QTYPES + K_QTYPES)
def test_dequantize_kernel_equals_gguf_py(qtype):
    n, k = 70, 768  # Q6_K: 3 super-blocks a row, so odd blocks start 2-byte aligned
    qweight = packed(n, k, qtype, seed=qtype)
    want = q.dequantize(qweight.cpu(), qtype, k)
    got = gguf_dequantize_cuda(cuda_ops(), qweight, qtype, k, torch.float16)
    assert torch.equal(got.cpu(), want.to(torch.float16))
    rows = torch.tensor([5, 0, 69, 5], device="cuda")
    emb = q.embedding_rows(qweight, qtype, k, rows, torch.bfloat16)
    assert torch.equal(emb.cpu(), want[[5, 0, 69, 5]].to(torch.bfloat16))


def test_bad_qtype_is_named():
    qweight = packed(8, 32, 2, seed=0)
    x = torch.randn(1, 32, device="cuda", dtype=torch.float16)
    out = torch.empty(1, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="qtype=10"):  # Q2_K
        cuda_ops().gguf_gemv(**gemv_kwargs(out, x, qweight, m=1, n=8, k=32, qtype=10))


def test_kquant_layout_errors_are_named():
    """A K-quant row must be whole super-blocks (k a multiple of 256) starting 16-byte aligned."""
    qweight = packed(8, 256, 12, seed=0)
    x = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    out = torch.empty(1, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of 256"):
        cuda_ops().gguf_gemv(**gemv_kwargs(out, x, qweight, m=1, n=8, k=128, qtype=12))
    with pytest.raises(ValueError, match="16-byte aligned"):
        cuda_ops().gguf_gemv(**gemv_kwargs(out, x, qweight, m=1, n=8, k=256, qtype=12,
                                           qweight=qweight.data_ptr() + 4))


def test_fused_gemv_argument_errors_are_named():
    qweight = packed(8, 64, 2, seed=0)
    x = torch.randn(1, 64, device="cuda", dtype=torch.float16)
    out = torch.empty(1, 8, device="cuda", dtype=torch.float16)
    args = dict(m=1, n=8, k=64, qtype=2)
    with pytest.raises(ValueError, match="prologue=2"):  # SiLU-and-mul runs as its own op
        cuda_ops().gguf_gemv(**gemv_kwargs(out, x, qweight, prologue=2, **args))
    with pytest.raises(ValueError, match="norm_weight"):
        cuda_ops().gguf_gemv(**gemv_kwargs(out, x, qweight, prologue=1, **args))
    with pytest.raises(ValueError, match="even n"):
        cuda_ops().gguf_gemv(**gemv_kwargs(out, x, qweight, silu_mul_out=1, m=1, n=7, k=64,
                                           qtype=2))
    with pytest.raises(ValueError, match="norm_weight and silu_mul"):
        q.quantized_fused_linear(x, qweight, 2, 64, norm_weight=x[0], silu_mul=True)


def gemv_kwargs(out_t, x_t, w_t, *, m, n, k, qtype, **overrides):
    """Every argument of `_cuda.gguf_gemv`: no bias, residual or prologue unless overridden."""
    args = dict(out=out_t.data_ptr(), x=x_t.data_ptr(), qweight=w_t.data_ptr(), bias=0,
                residual=0, norm_weight=0, m=m, n=n, k=k, x_stride=k, out_stride=n,
                residual_stride=n, eps=1e-5, prologue=0, silu_mul_out=0, qtype=qtype, dtype=1,
                stream=0)
    args.update(overrides)
    return args
