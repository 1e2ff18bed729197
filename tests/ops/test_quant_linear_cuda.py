"""The weight-only quantized GEMV and dequantize kernels (cuda/quant_gemv.cuh) against the torch
reference of ops/quant_linear.py."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops import quant_linear as ql
from tinyvllm.ops._dispatch import cuda_ops
from tinyvllm.ops.quant_linear_cuda import quant_dequantize_cuda, quant_linear_cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def make_weight(n, k, bits, group_size, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, device="cuda", dtype=torch.int32)
    groups = k // group_size
    scales = (torch.rand(n, groups, generator=gen, device="cuda") * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen, device="cuda").to(dtype)
    return ql.pack(q, bits), scales, zeros


def rel_err(out, ref):
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("n,k,group_size", [(7, 64, 32), (1001, 576, 64), (576, 1536, 128),
                                            (4104, 4096, 128), (96, 14336, 14336),
                                            (333, 4128, 32)])
def test_quant_linear_matches_reference(dtype, bits, m, n, k, group_size):
    seed = m * 7919 + n * 31 + k + bits
    qweight, scales, zeros = make_weight(n, k, bits, group_size, dtype, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype) if n % 2 else None
    out = ql.quant_linear(x, qweight, scales, zeros, bits, group_size, bias=bias)
    # The reference in float32 over the same dequantized weight: the kernel accumulates in float.
    ref = ql.quant_linear_ref(x.float(), qweight, scales.float(), zeros.float(), bits,
                              group_size, bias=None if bias is None else bias.float())
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < (3e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["simt", "mma"])
@pytest.mark.parametrize("m", [1, 2, 7, 8])
@pytest.mark.parametrize("n,k,group_size", [(7, 64, 32), (1001, 576, 64), (4104, 4096, 128),
                                            (96, 14336, 14336), (333, 4160, 32)])
def test_both_gemv_kernels_match_reference(dtype, method, m, n, k, group_size):
    seed = m * 7919 + n * 31 + k
    qweight, scales, zeros = make_weight(n, k, 4, group_size, dtype, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    out = quant_linear_cuda(cuda_ops(), x, qweight, scales, zeros, 4, group_size, bias=bias,
                            method=method)
    ref = ql.quant_linear_ref(x.float(), qweight, scales.float(), zeros.float(), 4, group_size,
                              bias=bias.float())
    assert rel_err(out, ref) < (3e-3 if dtype == torch.float16 else 1e-2)


def test_act_order_permutation_and_leading_dims():
    n, k, bits, group_size = 256, 512, 4, 128
    qweight, scales, zeros = make_weight(n, k, bits, group_size, torch.float16, 3)
    perm = torch.randperm(k, device="cuda")
    x = torch.randn(2, 3, k, device="cuda", dtype=torch.float16)
    out = ql.quant_linear(x, qweight, scales, zeros, bits, group_size, perm=perm)
    ref = ql.quant_linear_ref(x.float(), qweight, scales.float(), zeros.float(), bits,
                              group_size, perm=perm)
    assert out.shape == (2, 3, n)
    assert rel_err(out, ref) < 3e-3


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_kernel_is_exact(bits):
    qweight, scales, zeros = make_weight(130, 256, bits, 64, torch.bfloat16, bits)
    got = quant_dequantize_cuda(cuda_ops(), qweight, scales, zeros, bits, 64)
    want = ql.dequantize(qweight, scales, zeros, bits, 64)
    assert torch.equal(got, want)


def test_unserved_shapes_raise_naming_the_argument():
    kernel = cuda_ops()
    qweight, scales, zeros = make_weight(8, 64, 4, 32, torch.float16, 0)
    x = torch.randn(9, 64, device="cuda", dtype=torch.float16)
    out = torch.empty(9, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="m=9"):
        kernel.quant_gemv(out=out.data_ptr(), x=x.data_ptr(), qweight=qweight.data_ptr(),
                          scales=scales.data_ptr(), zeros=zeros.data_ptr(), bias=0, m=9, n=8,
                          k=64, x_stride=64, out_stride=8, bits=8, group_size=32, method=0,
                          dtype=1, stream=0)
    with pytest.raises(ValueError, match="method=2"):
        kernel.quant_gemv(out=out.data_ptr(), x=x.data_ptr(), qweight=qweight.data_ptr(),
                          scales=scales.data_ptr(), zeros=zeros.data_ptr(), bias=0, m=1, n=8,
                          k=96, x_stride=96, out_stride=8, bits=4, group_size=32, method=2,
                          dtype=1, stream=0)
    with pytest.raises(ValueError, match="group_size=48"):
        kernel.quant_dequantize(out=out.data_ptr(), qweight=qweight.data_ptr(),
                                scales=scales.data_ptr(), zeros=zeros.data_ptr(), n=8, k=96,
                                bits=4, group_size=48, dtype=1, stream=0)
