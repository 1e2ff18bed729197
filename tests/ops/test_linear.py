"""`ops.fused_linear` on the CPU: the reference the GEMV kernel is checked against."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyvllm.ops.layers import rms_norm_ref, silu_and_mul_ref
from tinyvllm.ops.linear import fused_linear, fused_linear_supported


def test_cpu_runs_the_reference_with_the_unfused_roundings():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=gen).bfloat16()
    weight = torch.randn(5, 16, generator=gen).bfloat16()
    residual = torch.randn(3, 5, generator=gen).bfloat16()
    assert not fused_linear_supported(x, weight)

    expected = residual + F.linear(silu_and_mul_ref(x), weight)
    got = fused_linear(x, weight, silu_mul=True, residual=residual)
    assert got is residual and torch.equal(got, expected)

    x16, norm_w = x[:, :16], torch.randn(16, generator=gen).bfloat16()
    out = torch.empty(3, 5, dtype=torch.bfloat16)
    got = fused_linear(x16, weight, norm_weight=norm_w, eps=1e-5, out=out)
    assert got is out and torch.equal(out, F.linear(rms_norm_ref(x16, norm_w, 1e-5), weight))


def test_norm_and_silu_exclude_each_other():
    with pytest.raises(ValueError, match="norm_weight and silu_mul"):
        fused_linear(torch.ones(1, 16), torch.ones(2, 8), norm_weight=torch.ones(8), silu_mul=True)


def test_silu_mul_out_is_the_swiglu_of_the_projection():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, generator=gen).bfloat16()
    weight = torch.randn(6, 16, generator=gen).bfloat16()
    norm_w = torch.randn(16, generator=gen).bfloat16()
    got = fused_linear(x, weight, norm_weight=norm_w, eps=1e-5, silu_mul_out=True)
    want = silu_and_mul_ref(F.linear(rms_norm_ref(x, norm_w, 1e-5), weight))
    assert got.shape == (2, 3) and torch.equal(got, want)
    with pytest.raises(ValueError, match="even number of weight rows, got 5"):
        fused_linear(x, weight[:5], silu_mul_out=True)
    with pytest.raises(ValueError, match="neither silu_mul nor a residual"):
        fused_linear(x, weight, silu_mul_out=True, residual=torch.zeros(2, 3).bfloat16())
