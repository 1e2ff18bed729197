"""The GGUF block GEMV and dequantize kernels (cuda/gguf_gemv.cuh) against gguf-py's
dequantization (ops/quantized.py's references)."""

from __future__ import annotations

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
        cuda_ops().gguf_gemv(out=out.data_ptr(), x=x.data_ptr(), qweight=qweight.data_ptr(),
                             bias=0, m=1, n=8, k=32, x_stride=32, out_stride=8, qtype=10, dtype=1,
                             stream=0)


def test_kquant_layout_errors_are_named():
    """A K-quant row must be whole super-blocks (k a multiple of 256) starting 16-byte aligned."""
    qweight = packed(8, 256, 12, seed=0)
    x = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    out = torch.empty(1, 8, device="cuda", dtype=torch.float16)
    kwargs = dict(out=out.data_ptr(), x=x.data_ptr(), bias=0, m=1, n=8, x_stride=256,
                  out_stride=8, qtype=12, dtype=1, stream=0)
    with pytest.raises(ValueError, match="multiple of 256"):
        cuda_ops().gguf_gemv(qweight=qweight.data_ptr(), k=128, **kwargs)
    with pytest.raises(ValueError, match="16-byte aligned"):
        cuda_ops().gguf_gemv(qweight=qweight.data_ptr() + 4, k=256, **kwargs)
