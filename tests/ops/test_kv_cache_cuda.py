"""CUDA reshape_and_cache (and the fused rotary + cache write) against the torch reference, for
caches of the activation dtype and FP8 (E4M3) caches with scales."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops._dispatch import cuda_ops
from tinyvllm.ops.kv_cache import FP8_DTYPE, PADDING_SLOT, reshape_and_cache, reshape_and_cache_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def kernels():
    module = cuda_ops()
    assert module is not None and hasattr(module, "reshape_and_cache"), "tinyvllm._cuda not built"
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (8, 128), (1, 36), (5, 7)])
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "qkv_view"])
def test_matches_reference(kernels, dtype, num_kv_heads, head_dim, fused):
    gen = torch.Generator(device="cuda").manual_seed(num_kv_heads * 1000 + head_dim)
    num_tokens, num_blocks, block_size = 37, 11, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[::5] = PADDING_SLOT  # padded tokens are skipped
    width = num_kv_heads * head_dim
    if fused:  # key and value as views into one projection output, as the model produces them
        qkv = torch.randn(num_tokens, 3 * width, generator=gen, device="cuda").to(dtype)
        key = qkv[:, width:2 * width].view(num_tokens, num_kv_heads, head_dim)
        value = qkv[:, 2 * width:].view(num_tokens, num_kv_heads, head_dim)
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
        value = torch.randn_like(key)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")  # poison
    expected = cache.clone()
    reshape_and_cache(key, value, cache, slots)
    reshape_and_cache_ref(key, value, expected, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    assert int((~cache.isnan()).sum()) == 2 * int((slots >= 0).sum()) * width


def test_dtype_mismatch_raises(kernels):
    key = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 3, 16, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_cache"):
        reshape_and_cache(key, key, cache, torch.arange(4, device="cuda"))


# ---- FP8 (E4M3) cache -----------------------------------------------------------------------------

NAN_BYTE = 0x7F  # E4M3 'fn' NaN: poison for FP8 slots
SCALES = {"unit": (1.0, 1.0), "scaled": (0.37, 2.5)}


def fp8_cache(num_blocks, block_size, num_kv_heads, head_dim):
    cache = torch.empty((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=FP8_DTYPE,
                        device="cuda")
    cache.view(torch.uint8).fill_(NAN_BYTE)
    return cache


def scale_tensors(name):
    return tuple(torch.tensor(s, dtype=torch.float32, device="cuda") for s in SCALES[name])


@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (8, 128), (1, 36), (5, 7)])
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "qkv_view"])
def test_fp8_matches_reference(kernels, dtype, num_kv_heads, head_dim, fused, scales):
    """Quantised bytes equal the reference's exactly (x / scale, saturated, nearest even);
    padded slots stay NaN."""
    gen = torch.Generator(device="cuda").manual_seed(num_kv_heads * 1000 + head_dim)
    num_tokens, num_blocks, block_size = 37, 11, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[::5] = PADDING_SLOT
    width = num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, 3 * width, generator=gen, device="cuda") * 100  # some saturate
    qkv = qkv.to(dtype)
    if fused:
        key = qkv[:, width:2 * width].view(num_tokens, num_kv_heads, head_dim)
        value = qkv[:, 2 * width:].view(num_tokens, num_kv_heads, head_dim)
    else:
        key = qkv[:, width:2 * width].reshape(num_tokens, num_kv_heads, head_dim).contiguous()
        value = qkv[:, 2 * width:].reshape(num_tokens, num_kv_heads, head_dim).contiguous()
    k_scale, v_scale = scale_tensors(scales)
    cache = fp8_cache(num_blocks, block_size, num_kv_heads, head_dim)
    expected = cache.clone()
    reshape_and_cache(key, value, cache, slots, k_scale, v_scale)
    reshape_and_cache_ref(key, value, expected, slots, k_scale, v_scale)
    got, want = cache.view(torch.uint8), expected.view(torch.uint8)
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
    written = int((got != NAN_BYTE).sum())
    assert written == 2 * int((slots >= 0).sum()) * width


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_tokens,heads,head_dim", [(1, (9, 3), 64), (37, (32, 8), 128),
                                                       (130, (4, 4), 64)])
def test_fp8_rotary_embedding_and_cache(kernels, dtype, num_tokens, heads, head_dim):
    """Fused rotary + FP8 cache write: the cached key is the kernel's own rotated key quantised,
    the value the reference's quantised value (both exact); padded slots stay NaN."""
    from tinyvllm.ops.kv_cache import quantize_kv
    from tinyvllm.ops.layers import build_cos_sin_cache, rotary_embedding_and_cache
    num_heads, num_kv_heads = heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    qkv = (torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen, device="cuda") * 3).to(dtype)
    value = qkv[:, q_size + kv_size:].clone()
    num_blocks, block = 3 + (num_tokens * 2) // 16, 16
    slots = torch.randperm(num_blocks * block, generator=gen, device="cuda")[:num_tokens]
    slots[::4] = PADDING_SLOT
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen, device="cuda")
    cos_sin = build_cos_sin_cache(head_dim, 4096, 500000.0, None, device="cuda")
    k_scale, v_scale = scale_tensors("scaled")
    cache = fp8_cache(num_blocks, block, num_kv_heads, head_dim)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    _, got_k = rotary_embedding_and_cache(positions, q, k, v, cos_sin, head_dim, cache, slots,
                                          k_scale, v_scale)
    flat = cache.view(torch.uint8).view(2, num_blocks * block, kv_size)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]], quantize_kv(got_k[keep], k_scale).view(torch.uint8))
    assert torch.equal(flat[1, slots[keep]], quantize_kv(value[keep], v_scale).view(torch.uint8))
    assert int((flat != NAN_BYTE).sum()) == 2 * int(keep.sum()) * kv_size


def test_fp8_bad_scale_raises(kernels):
    key = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    cache = fp8_cache(3, 16, 2, 64)
    slots = torch.arange(4, device="cuda")
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache(key, key, cache, slots, torch.tensor([1.0, 2.0], device="cuda"))
    with pytest.raises(ValueError, match="v_scale"):
        reshape_and_cache(key, key, cache, slots, None, torch.tensor(1.0, device="cuda").half())
