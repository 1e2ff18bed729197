"""`ops.fused_linear` on the CPU: the reference the GEMV kernel is checked against, and the
choice of the fused decode path (`ops.use_fused_decode`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyvllm import ops
from tinyvllm.config import KernelConfig
from tinyvllm.ops import linear
from tinyvllm.ops.layers import rms_norm_ref, silu_and_mul_ref
from tinyvllm.ops.linear import fused_linear, fused_linear_supported, use_fused_decode


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


# ---- which decode path runs: the engine's KernelConfig and what the kernel serves ---------------

class CudaActivations:
    """Stands in for a CUDA [num_tokens, hidden] bfloat16 tensor (this machine has no GPU)."""

    is_cuda = True
    dtype = torch.bfloat16

    def __init__(self, num_tokens: int, hidden: int) -> None:
        self.shape = (num_tokens, hidden)

    def element_size(self) -> int:
        return 2


@pytest.fixture
def gpu_runs_the_gemv(monkeypatch):
    """A GPU whose fused_linear kernel runs; the kernel choices restored afterwards."""
    monkeypatch.setattr(linear, "kernel_enabled", lambda op: op == "fused_linear")
    yield
    ops.configure(KernelConfig())


def projections(hidden: int = 64) -> list[torch.nn.Module]:
    return [torch.nn.Linear(hidden, 3 * hidden, device="meta"),
            torch.nn.Linear(hidden, hidden, device="meta")]


def test_fused_decode_follows_the_kernel_config(gpu_runs_the_gemv):
    decode, pair, verify, prefill = (CudaActivations(m, 64) for m in (1, 2, 5, 17))
    weight = projections()[0].weight
    assert [linear._gemv_kernel(x.shape[0], x, weight) for x in (decode, pair, verify)] == [0, 0, 1]
    for x in (decode, pair, verify):  # the scalar GEMV to 2 rows, tensor cores to 16
        assert use_fused_decode(x, *projections())
    assert not use_fused_decode(prefill, *projections())  # past both kernels' rows: cuBLAS

    ops.configure(KernelConfig(gemv_max_rows=1))
    assert use_fused_decode(pair, *projections())
    assert linear._gemv_kernel(2, pair, weight) == 1

    ops.configure(KernelConfig(gemv_mma_max_rows=0))
    assert use_fused_decode(pair, *projections())
    assert not use_fused_decode(verify, *projections())

    ops.configure(KernelConfig(gemv_max_rows=1, gemv_mma_max_rows=0))
    assert use_fused_decode(decode, *projections())
    assert not use_fused_decode(pair, *projections())
    assert not fused_linear_supported(pair, weight)

    ops.configure(KernelConfig(gemv_max_rows=0))  # every decode-sized batch on tensor cores
    assert linear._gemv_kernel(1, decode, weight) == 1

    ops.configure(KernelConfig(batch_invariant=True))  # every row on tensor cores, in chunks
    assert [linear._gemv_kernel(x.shape[0], x, weight)
            for x in (decode, pair, verify, prefill)] == [2, 2, 2, 2]  # INVARIANT_CHUNKS
    assert use_fused_decode(prefill, *projections())  # 16 rows a launch
    assert use_fused_decode(CudaActivations(5, 4096), torch.nn.Linear(4096, 16, device="meta"))
    # Llama-3-8B's down_proj: 4 rows a launch
    assert use_fused_decode(CudaActivations(300, 14336),
                            torch.nn.Linear(14336, 4096, device="meta"))
    assert not use_fused_decode(CudaActivations(1, 96), *projections(96))  # k % 64 != 0

    ops.configure(KernelConfig(fused_gemv=False))
    assert not use_fused_decode(decode, *projections())


def test_fused_decode_needs_plain_weights_the_kernel_takes(gpu_runs_the_gemv):
    x = CudaActivations(1, 64)
    packed = torch.nn.Module()  # e.g. GGUF rows (model/packed.py): no dense weight
    assert not use_fused_decode(x, projections()[0], packed)
    assert not use_fused_decode(CudaActivations(1, 60), *projections(60))  # k % 8 != 0
    # The tensor-core GEMV takes k in tiles of 64 and n in bands of 16, and stages at most
    # 64K activations (m rounded up to 4, 8 or 16).
    assert use_fused_decode(CudaActivations(1, 96), *projections(96))
    assert not use_fused_decode(CudaActivations(5, 96), *projections(96))  # k % 64 != 0
    assert not use_fused_decode(CudaActivations(5, 64), torch.nn.Linear(64, 40, device="meta"))
    wide = torch.nn.Linear(8192, 16, device="meta")
    assert fused_linear_supported(CudaActivations(5, 8192), wide.weight)
    assert not fused_linear_supported(CudaActivations(9, 8192), wide.weight)
    # A decoder layer takes the tensor-core GEMV up to k = 2048 (beyond, cuBLAS is as fast).
    assert use_fused_decode(CudaActivations(5, 2048), torch.nn.Linear(2048, 16, device="meta"))
    assert not use_fused_decode(CudaActivations(5, 4096),
                                torch.nn.Linear(4096, 16, device="meta"))
    assert use_fused_decode(CudaActivations(2, 4096), torch.nn.Linear(4096, 16, device="meta"))


class PackedProjection(torch.nn.Module):
    """A packed projection with a fused GEMV of its own (as W4A16 tiles) serving up to 32 rows."""

    def fused_serves(self, x) -> bool:
        return x.shape[0] <= 32


def test_packed_projections_take_the_fused_decode_where_they_serve_but_not_batch_invariant(
        gpu_runs_the_gemv):
    x, many = CudaActivations(4, 64), CudaActivations(33, 64)
    assert use_fused_decode(x, projections()[0], PackedProjection())
    assert not use_fused_decode(many, projections()[0], PackedProjection())
    ops.configure(KernelConfig(batch_invariant=True))  # rows computed alike only on 16-bit weights
    assert use_fused_decode(many, *projections())
    assert not use_fused_decode(x, projections()[0], PackedProjection())


def test_cpu_batches_never_take_the_fused_decode():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert ops.kernel_config().fused_gemv
    assert not use_fused_decode(x, *projections())
