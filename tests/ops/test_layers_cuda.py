"""CUDA RMSNorm(+residual), SiLU-and-mul and rotary embedding against the torch references; the
RMSNorm and SiLU-and-mul fused with a W8A8 projection's input quantization against the unfused
kernels."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops._dispatch import cuda_ops, dtype_code
from tinyvllm.ops.layers import (build_cos_sin_cache, rms_norm_quant, rms_norm_ref,
                                 rotary_embedding, rotary_embedding_ref, silu_and_mul_quant,
                                 silu_and_mul_ref)
from tinyvllm.ops.w8a8_linear import QMAX, quantize_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def kernels():
    module = cuda_ops()
    assert module is not None and hasattr(module, "rms_norm"), "tinyvllm._cuda not built"
    return module


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel <= REL_TOL[dtype], f"relative error {rel:.2e}"


def rand(*shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (37, 4096), (5, 4099), (3, 8192)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(kernels, dtype, num_tokens, hidden, with_residual):
    from tinyvllm.ops.layers_cuda import rms_norm_cuda
    x = rand(num_tokens, hidden, dtype=dtype, seed=hidden)
    weight = rand(hidden, dtype=dtype, seed=1)
    residual = rand(num_tokens, hidden, dtype=dtype, seed=2) if with_residual else None
    expected = rms_norm_ref(x, weight, 1e-6, residual)
    out = torch.full_like(x, float("nan"))
    got = rms_norm_cuda(kernels, x, weight, 1e-6,
                        None if residual is None else residual.clone(), out=out)
    if with_residual:
        assert got[0] is out
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)  # same rounding
        assert_rel_close(out, expected[0], dtype)
    else:
        assert got is out
        assert_rel_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 1536), (37, 7168), (9, 4099), (2, 7)])
def test_silu_and_mul(kernels, dtype, num_tokens, d):
    from tinyvllm.ops.layers_cuda import silu_and_mul_cuda
    wide = rand(num_tokens, 2 * d + 16, dtype=dtype, seed=d)
    x = wide[:, 8:8 + 2 * d]  # strided rows, offset start: exercises the narrow path too
    out = torch.full((num_tokens, d), float("nan"), dtype=dtype, device="cuda")
    silu_and_mul_cuda(kernels, x, out=out)
    assert_rel_close(out, silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (32, 8)])
def test_rotary_embedding_in_place(kernels, dtype, head_dim, num_heads, num_kv_heads):
    num_tokens, max_position = 41, 8192
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cache = build_cos_sin_cache(head_dim, max_position, 500000.0, scaling, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen, device="cuda")
    q_width, k_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = rand(num_tokens, q_width + 2 * k_width, dtype=dtype, seed=7)
    query, key = qkv[:, :q_width], qkv[:, q_width:q_width + k_width]  # strided views
    expected_q, expected_k = rotary_embedding_ref(positions, query.clone(), key.clone(), cache,
                                                  head_dim)
    value_before = qkv[:, q_width + k_width:].clone()
    got_q, got_k = rotary_embedding(positions, query, key, cache, head_dim)
    assert got_q.data_ptr() == query.data_ptr() and got_k.data_ptr() == key.data_ptr()
    assert_rel_close(query, expected_q, dtype)
    assert_rel_close(key, expected_k, dtype)
    torch.testing.assert_close(qkv[:, q_width + k_width:], value_before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_tokens,heads,head_dim", [(1, (9, 3), 64), (37, (32, 8), 128),
                                                       (5, (12, 1), 128), (130, (4, 4), 64)])
def test_rotary_embedding_and_cache(kernels, dtype, num_tokens, heads, head_dim):
    """Fused rotary + KV write on strided views of a qkv output, padding slots skipped, against
    rotary_embedding_ref + reshape_and_cache_ref; untouched cache slots keep their poison."""
    from tinyvllm.ops.layers import rotary_embedding_and_cache, rotary_embedding_and_cache_ref
    num_heads, num_kv_heads = heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = rand(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=num_tokens)
    num_blocks, block = 3 + (num_tokens * 2) // 16, 16
    gen = torch.Generator().manual_seed(num_tokens)
    slots = torch.randperm(num_blocks * block, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding
    slots = slots.to("cuda")
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to("cuda")
    cos_sin = build_cos_sin_cache(head_dim, 4096, 500000.0,
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}, device="cuda")
    poison = torch.full((2, num_blocks, block, num_kv_heads, head_dim), 1234.0, dtype=dtype,
                        device="cuda")
    ref_cache = poison.clone()
    q, k, v = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
    ref_q, ref_k = rotary_embedding_and_cache_ref(positions, q, k, v, cos_sin, head_dim,
                                                  ref_cache, slots)
    cache = poison.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views
    got_q, got_k = rotary_embedding_and_cache(positions, q, k, v, cos_sin, head_dim, cache, slots)
    assert got_q.data_ptr() == qkv.data_ptr()  # in place
    assert_rel_close(got_q, ref_q, dtype)
    assert_rel_close(got_k, ref_k, dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(cache, ref_cache, rtol=tol, atol=tol)
    assert (cache == 1234.0).any(), "some slots must stay untouched"


# --- RMSNorm and SiLU-and-mul fused with the per-token quantization (quant_act.cuh) ---------------

FP8 = torch.float8_e4m3fn
QUANTS = [(torch.int8, 127.0), (torch.int8, 127.5), (FP8, 448.0)]
QUANT_IDS = ["int8-127", "int8-127.5", "fp8-448"]
POISON_BYTE = 0x55


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """The fused ops' q and scales allocated full of poison (0x55 bytes, NaN scales), so that an
    element the kernel leaves unwritten fails the comparison."""
    from tinyvllm.ops import layers_cuda

    def poisoned(num_tokens, k, qdtype, device):
        q = torch.full((num_tokens, k), POISON_BYTE, dtype=torch.uint8, device=device)
        return q.view(qdtype), torch.full((num_tokens, 1), float("nan"), device=device)

    monkeypatch.setattr(layers_cuda, "quantized_output", poisoned)


def static_scale(rows: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """A per-tensor scale that clips the largest values (60% of max|rows| / QMAX); positive
    when every row is zero (one token, the zero row), as a calibrated scale is."""
    return (rows.float().abs().max().clamp(min=1.0) / QMAX[qdtype] * 0.6).reshape(())


def assert_same_rows(rows, q: torch.Tensor, scales: torch.Tensor) -> None:
    assert rows.q.dtype == q.dtype and rows.q.shape == q.shape and rows.scales.shape == scales.shape
    assert torch.equal(rows.scales, scales), "scales differ (NaN: unwritten)"
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype,divisor", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("num_tokens,hidden,pad", [(1, 576, 0), (3, 4096, 0), (257, 8192, 0),
                                                   (3, 14336, 0), (5, 96, 8), (3, 40, 0),
                                                   (3, 42, 0), (2, 4099, 0), (4, 4096, 3)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_rms_norm_quant_equals_rms_norm_then_quantize_rows(kernels, poisoned_outputs, dtype,
                                                           qdtype, divisor, num_tokens, hidden,
                                                           pad, with_residual, static):
    """Bit for bit the unfused CUDA pair, rms_norm then quantize_rows of its output, and the same
    residual: 16-byte packs held in registers (40 .. 8192; 40: fewer packs than threads), packs
    past the held ones computed again (14336; float32 past 4096), single elements (42, 4099: no
    16-byte multiple; x with a row stride of 4099), a row of zeros, static scales that clip,
    either convention's divisor."""
    from tinyvllm.ops.layers_cuda import rms_norm_cuda
    x = (rand(num_tokens, hidden + pad, dtype=dtype, seed=hidden + num_tokens) * 3)[:, :hidden]
    weight = rand(hidden, dtype=dtype, seed=1)
    residual = rand(num_tokens, hidden, dtype=dtype, seed=2) if with_residual else None
    x[num_tokens // 2] = 0
    if residual is not None:
        residual[num_tokens // 2] = 0
    unfused = rms_norm_cuda(kernels, x, weight, 1e-6,
                            None if residual is None else residual.clone())
    normed = unfused if residual is None else unfused[0]
    scale = static_scale(normed, qdtype) if static else None
    q, scales = quantize_rows(normed, qdtype, scale, divisor)
    fused = rms_norm_quant(x, weight, 1e-6, None if residual is None else residual.clone(),
                           qdtype, divisor, scale)
    rows = fused if residual is None else fused[0]
    assert rows.dtype == dtype
    assert_same_rows(rows, q, scales)
    if residual is not None:
        assert torch.equal(fused[1], unfused[1])
    assert not bool(rows.q[num_tokens // 2].float().any())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype,divisor", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("num_tokens,d,pad", [(1, 576, 0), (3, 4096, 0), (257, 14336, 0),
                                              (2, 28672, 0), (5, 96, 8), (3, 40, 0), (3, 42, 0),
                                              (2, 4099, 0), (4, 1536, 3)])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_silu_and_mul_quant_equals_silu_and_mul_then_quantize_rows(kernels, poisoned_outputs,
                                                                   dtype, qdtype, divisor,
                                                                   num_tokens, d, pad, static):
    """Bit for bit the unfused CUDA pair, silu_and_mul then quantize_rows of its output: held
    16-byte packs (40 .. 14336 in 16 bits), packs computed again (28672; float32 past 8192),
    single elements (42, 4099, and a row stride of 2 * 1536 + 3), a row of zeros, static scales
    that clip, either convention's divisor."""
    from tinyvllm.ops.layers_cuda import silu_and_mul_cuda
    x = (rand(num_tokens, 2 * d + pad, dtype=dtype, seed=d + num_tokens) * 4)[:, :2 * d]
    x[num_tokens // 2] = 0
    product = silu_and_mul_cuda(kernels, x)
    scale = static_scale(product, qdtype) if static else None
    q, scales = quantize_rows(product, qdtype, scale, divisor)
    rows = silu_and_mul_quant(x, qdtype, divisor, scale)
    assert rows.dtype == dtype
    assert_same_rows(rows, q, scales)
    assert not bool(rows.q[num_tokens // 2].float().any())


def test_fused_quant_launchers_name_bad_arguments(kernels):
    x = torch.randn(2, 32, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(2, 16, dtype=torch.int8, device="cuda")
    common = dict(out=q.data_ptr(), scales=x.data_ptr(), x=x.data_ptr(), static_scale=0,
                  num_tokens=2, x_stride=32, out_stride=16, qmax=127.0, min_absmax=1e-10,
                  dtype=dtype_code(x.dtype), stream=0)
    norm = dict(common, residual=0, weight=x.data_ptr(), residual_stride=0, eps=1e-6)

    with pytest.raises(ValueError, match="rms_norm_quant: qdtype must be int8 or float8_e4m3fn"):
        kernels.rms_norm_quant(**norm, hidden=16, scale_divisor=127.0,
                               qdtype=dtype_code(torch.float16))
    with pytest.raises(ValueError, match="rms_norm_quant: hidden=0 must be positive"):
        kernels.rms_norm_quant(**norm, hidden=0, scale_divisor=127.0,
                               qdtype=dtype_code(torch.int8))
    with pytest.raises(ValueError, match="silu_and_mul_quant: scale_divisor must be positive"):
        kernels.silu_and_mul_quant(**common, d=16, scale_divisor=0.0,
                                   qdtype=dtype_code(torch.int8))
