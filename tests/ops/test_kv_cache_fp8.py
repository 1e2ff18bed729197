"""FP8 (E4M3) KV cache: the torch reference's quantisation, cache writes and attention (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from tinyvllm.ops.attention import AttentionMetadata, paged_attention_ref
from tinyvllm.ops.kv_cache import (FP8_DTYPE, FP8_E4M3_MAX, PADDING_SLOT, allocate_kv_caches,
                                   dequantize_kv, quantize_kv, reshape_and_cache_ref,
                                   resolve_kv_cache_dtype)
from tinyvllm.ops.layers import rotary_embedding_and_cache_ref

NAN_BYTE = 0x7F  # E4M3 'fn' NaN: the poison of unwritten FP8 slots
MIN_NORMAL = 2.0 ** -6  # smallest normal E4M3 magnitude
SUBNORMAL_STEP = 2.0 ** -9  # spacing of E4M3 subnormals


@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.5])
def test_round_trip_error_bound(scale):
    """|x - dq(q(x))| <= 2^-4 |x| in the normal range (3 mantissa bits, round to nearest) and
    <= half a subnormal step (times scale) below it."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-12, math.log2(FP8_E4M3_MAX), 4001, base=2.0)
    signs = torch.where(torch.rand(4001, generator=gen) < 0.5, -1.0, 1.0)
    x = (magnitudes * signs * scale).double()
    s = torch.tensor(scale)
    back = dequantize_kv(quantize_kv(x, s), s, torch.float64)
    err = (back - x).abs()
    normal = x.abs() >= MIN_NORMAL * scale
    assert (err[normal] <= 2.0 ** -4 * x.abs()[normal] * (1 + 1e-6)).all()
    assert (err[~normal] <= SUBNORMAL_STEP / 2 * scale * (1 + 1e-6)).all()
    assert quantize_kv(x, s).dtype == FP8_DTYPE


def test_saturates_instead_of_overflowing():
    scale = torch.tensor(0.5)
    x = torch.tensor([224.0, 230.0, 1e4, -1e4, float("inf"), -float("inf"), 1e30])
    got = dequantize_kv(quantize_kv(x, scale), scale, torch.float32)
    limit = FP8_E4M3_MAX * 0.5
    assert got.tolist() == [224.0, limit, limit, -limit, limit, -limit, limit]
    assert torch.isfinite(got).all()


def test_stored_value_is_x_over_scale():
    x = torch.tensor([[1.0, -3.0, 0.75, 104.0]])
    scale = torch.tensor(0.25)
    stored = quantize_kv(x, scale)
    assert stored.float().tolist() == [[4.0, -12.0, 3.0, 416.0]]  # all exact in E4M3
    assert dequantize_kv(stored, scale, torch.bfloat16).dtype == torch.bfloat16
    # Round to nearest even: 100 lies halfway between 96 and 104, 400 between 384 and 416.
    assert quantize_kv(torch.tensor([100.0, 400.0]), None).float().tolist() == [96.0, 384.0]


def test_resolve_kv_cache_dtype_and_allocation():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("fp16", torch.float32)
    caches = allocate_kv_caches(2, 5, 16, 3, 64, FP8_DTYPE, torch.device("cpu"))
    assert len(caches) == 2 and caches[0].dtype == FP8_DTYPE
    assert caches[0].shape == (2, 5, 16, 3, 64) and caches[0].element_size() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_fp8_quantises_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 3, 8
    cache = torch.empty((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=FP8_DTYPE)
    cache.view(torch.uint8).fill_(NAN_BYTE)
    key = (torch.randn(6, num_kv_heads, head_dim, generator=gen) * 4).to(dtype)
    value = (torch.randn(6, num_kv_heads, head_dim, generator=gen) / 3).to(dtype)
    slots = torch.tensor([13, PADDING_SLOT, 2, 7, PADDING_SLOT, 19])
    k_scale, v_scale = torch.tensor(0.37), torch.tensor(0.02)
    reshape_and_cache_ref(key, value, cache, slots, k_scale, v_scale)
    flat = cache.view(torch.uint8).view(2, -1, num_kv_heads, head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot != PADDING_SLOT:
            assert torch.equal(flat[0, slot], quantize_kv(key[token], k_scale).view(torch.uint8))
            assert torch.equal(flat[1, slot], quantize_kv(value[token], v_scale).view(torch.uint8))
    untouched = [s for s in range(num_blocks * block_size) if s not in slots.tolist()]
    assert (flat[:, untouched] == NAN_BYTE).all()
    written = flat[:, slots[slots >= 0]]
    assert (written != NAN_BYTE).all() and (written != 0xFF).all()  # finite, saturated if needed


def _paged_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, gen):
    """(query, fp32 cache, fp8 cache, meta, scales): the same K/V written into both caches."""
    nb = [-(-s // block_size) for _, s in seqs]
    num_blocks = sum(nb) + 2
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    full = torch.zeros(shape)
    fp8 = torch.zeros(shape, dtype=FP8_DTYPE)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), max(nb) + 1, dtype=torch.int32)
    slots = []
    for i, ((_, seq_len), n) in enumerate(zip(seqs, nb)):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size
                  for p in range(seq_len)]
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    scales = torch.tensor(0.05), torch.tensor(0.01)
    reshape_and_cache_ref(k, v, full, torch.tensor(slots))
    reshape_and_cache_ref(k, v, fp8, torch.tensor(slots), *scales)
    q_lens, seq_lens = [q for q, _ in seqs], [s for _, s in seqs]
    cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    meta = AttentionMetadata(
        num_tokens=cu[-1], slot_mapping=torch.zeros(cu[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=cu,
        seq_lens_cpu=seq_lens)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen)
    return query, full, fp8, meta, scales


@pytest.mark.parametrize("seqs", [
    [(7, 7), (3, 41), (1, 17), (20, 33)],  # prefill, chunked prefill over a prefix, decode
    [(1, 5), (1, 48), (1, 1), (1, 30)],  # batched pure decode
], ids=["mixed", "decode"])
def test_paged_attention_ref_reads_fp8(seqs):
    """Attention over an FP8 cache equals attention over its dequantised values exactly, and
    stays within a few percent of attention over the unquantised K/V."""
    gen = torch.Generator().manual_seed(len(seqs) + seqs[0][0])
    query, full, fp8, meta, (k_scale, v_scale) = _paged_batch(seqs, 8, 2, 32, 16, gen)
    scale = 32 ** -0.5
    got = paged_attention_ref(query, fp8, meta, scale, k_scale, v_scale)
    dequantised = torch.stack([dequantize_kv(fp8[0], k_scale, torch.float32),
                               dequantize_kv(fp8[1], v_scale, torch.float32)])
    rows = meta.num_seqs if meta.is_pure_decode else meta.num_tokens
    torch.testing.assert_close(
        got[:rows], paged_attention_ref(query, dequantised, meta, scale)[:rows], rtol=0, atol=0)
    exact = paged_attention_ref(query, full, meta, scale)[:rows]
    rel = ((got[:rows] - exact).norm() / exact.norm()).item()
    assert rel < 0.05, f"relative error {rel:.3f} against the unquantised cache"


def test_rotary_embedding_and_cache_ref_fp8(rotary_case):
    """The fused op's reference quantises the rotated key and the value with their scales."""
    c = rotary_case
    hkv, d, q, k, v, positions, slots, cos_sin = (c.hkv, c.d, c.q, c.k, c.v, c.positions,
                                                  c.slots, c.cos_sin)
    cache = torch.zeros((2, 2, 16, hkv, d), dtype=FP8_DTYPE)
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)
    _, got_k = rotary_embedding_and_cache_ref(positions, q, k, v, cos_sin, d, cache, slots,
                                              k_scale, v_scale)
    flat = cache.view(2, 32, hkv * d)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]].view(torch.uint8),
                       quantize_kv(got_k[keep], k_scale).view(torch.uint8))
    assert torch.equal(flat[1, slots[keep]].view(torch.uint8),
                       quantize_kv(v[keep], v_scale).view(torch.uint8))
