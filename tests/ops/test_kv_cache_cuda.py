"""CUDA reshape_and_cache against the torch reference."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops._dispatch import cuda_ops
from tinyvllm.ops.kv_cache import PADDING_SLOT, reshape_and_cache, reshape_and_cache_ref

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
