"""The torch references in `tinyvllm.ops` against naive implementations and transformers."""

from __future__ import annotations

import math

import pytest
import torch

from tinyvllm.ops.attention import AttentionMetadata, paged_attention_ref
from tinyvllm.ops.kv_cache import PADDING_SLOT, reshape_and_cache_ref
from tinyvllm.ops.layers import build_cos_sin_cache, rms_norm_ref, rotary_embedding_ref

POISON = 1.0e4  # finite garbage in unused cache slots: a wrong mask shows up as a huge error


def _dense_causal_attention(q, k, v, scale):
    """q: [q_len, h, d] at the last q_len positions; k, v: [seq_len, h_kv, d]. float64 math."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _build_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, gen):
    """Random paged batch; seqs: [(q_len, seq_len)]. Returns (query, cache, meta, dense kv)."""
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # + null block and spares
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), POISON)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # shuffled, never block 0
    width = max(blocks_per_seq) + 2
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)  # padding -> null block 0
    dense, slots = [], []
    for i, ((q_len, seq_len), nb) in enumerate(zip(seqs, blocks_per_seq)):
        tables[i, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        for pos in range(seq_len):
            block, offset = int(tables[i, pos // block_size]), pos % block_size
            cache[0, block, offset], cache[1, block, offset] = k[pos], v[pos]
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]
        dense.append((k, v))
    q_lens = [q for q, _ in seqs]
    seq_lens = [s for _, s in seqs]
    cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    meta = AttentionMetadata(
        num_tokens=cu[-1], slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(
            cu, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=cu, seq_lens_cpu=seq_lens)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen)
    return query, cache, meta, dense


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("seqs", [
    [(7, 7), (3, 41), (1, 17), (20, 33)],  # prefill, chunked prefill over a cached prefix, decode
    [(1, 5), (1, 48), (1, 1), (1, 30)],  # batched pure decode
    [(1, 29)],  # single-sequence decode
], ids=["ragged", "decode", "decode1"])
@pytest.mark.parametrize("block_size", [16, 8])
def test_paged_attention_matches_dense(seqs, num_heads, num_kv_heads, block_size):
    gen = torch.Generator().manual_seed(hash((len(seqs), num_heads, block_size)) % 2**31)
    head_dim = 32
    query, cache, meta, dense = _build_batch(seqs, num_heads, num_kv_heads, head_dim, block_size,
                                             gen)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention_ref(query, cache, meta, scale)
    cu = meta.query_start_loc_cpu
    for i, (k, v) in enumerate(dense):
        expected = _dense_causal_attention(query[cu[i]:cu[i + 1]], k, v, scale)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_skips_padding_slots():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 3, 8
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), POISON)
    key = torch.randn(6, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(6, num_kv_heads, head_dim, generator=gen)
    slots = torch.tensor([13, PADDING_SLOT, 2, 7, PADDING_SLOT, 19])
    before = cache.clone()
    reshape_and_cache_ref(key, value, cache, slots)
    flat, flat_before = cache.view(2, -1, num_kv_heads, head_dim), before.view(2, -1, num_kv_heads,
                                                                                head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot != PADDING_SLOT:
            assert torch.equal(flat[0, slot], key[token])
            assert torch.equal(flat[1, slot], value[token])
    untouched = [s for s in range(num_blocks * block_size) if s not in slots.tolist()]
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope_scaling,theta", [(None, 10000.0), (LLAMA3_SCALING, 500000.0)])
def test_rotary_matches_transformers(rope_scaling, theta):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, num_heads, num_kv_heads, max_pos = 64, 6, 2, 20000
    params = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling:
        params = {**rope_scaling, "rope_theta": theta}
    config = LlamaConfig(hidden_size=head_dim * num_heads, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=params)
    hf_rope = LlamaRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(1)
    # transformers multiplies float32 angles, so at large positions it drifts (~pos * 6e-8 rad)
    # from our float64 table; the tolerance allows that drift, not a wrong formula.
    positions = torch.tensor([0, 1, 5, 17, 1000, 9000, 19999])
    q = torch.randn(len(positions), num_heads, head_dim, generator=gen)
    k = torch.randn(len(positions), num_kv_heads, head_dim, generator=gen)
    cos, sin = hf_rope(q, positions.unsqueeze(0))  # [1, t, d]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    cache = build_cos_sin_cache(head_dim, max_pos, theta, rope_scaling)
    our_q, our_k = rotary_embedding_ref(positions, q.reshape(len(positions), -1),
                                        k.reshape(len(positions), -1), cache, head_dim)
    torch.testing.assert_close(our_q.view_as(q), hf_q[0].transpose(0, 1), atol=5e-3, rtol=0)
    torch.testing.assert_close(our_k.view_as(k), hf_k[0].transpose(0, 1), atol=5e-3, rtol=0)
    small = positions < 32
    torch.testing.assert_close(our_q.view_as(q)[small], hf_q[0].transpose(0, 1)[small],
                               atol=1e-5, rtol=1e-5)


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta = 128, 500000.0
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=head_dim,
                         rope_parameters={**LLAMA3_SCALING, "rope_theta": theta})
    inv_freq = LlamaRotaryEmbedding(config).inv_freq.double()
    cache = build_cos_sin_cache(head_dim, 2, theta, LLAMA3_SCALING)
    # Row 1 holds cos(inv_freq) | sin(inv_freq): recover the angles.
    ours = torch.atan2(cache[1, head_dim // 2:].double(), cache[1, :head_dim // 2].double())
    torch.testing.assert_close(ours, inv_freq, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    eps = 1e-6
    out, new_residual = rms_norm_ref(x, weight, eps, residual)
    summed = (x + residual).double()
    expected = summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    plain = rms_norm_ref(x, weight, eps)
    assert isinstance(plain, torch.Tensor) and plain.shape == x.shape


def test_rotary_embedding_and_cache_ref_equals_separate_ops(rotary_case):
    """The fused op's reference is rotary_embedding_ref then reshape_and_cache_ref (CPU)."""
    from tinyvllm.ops.kv_cache import reshape_and_cache_ref
    from tinyvllm.ops.layers import rotary_embedding_and_cache, rotary_embedding_ref
    c = rotary_case
    t, hkv, d, q, k, v, positions, slots, cos_sin = (c.t, c.hkv, c.d, c.q, c.k, c.v, c.positions,
                                                     c.slots, c.cos_sin)
    cache = torch.full((2, 2, 16, hkv, d), 7.0)
    got_q, got_k = rotary_embedding_and_cache(positions, q, k, v, cos_sin, d, cache, slots)
    ref_cache = torch.full_like(cache, 7.0)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cos_sin, d)
    keep = slots >= 0
    reshape_and_cache_ref(ref_k.view(t, hkv, d)[keep], v.reshape(t, hkv, d)[keep], ref_cache,
                          slots[keep])
    torch.testing.assert_close(got_q, ref_q)
    torch.testing.assert_close(got_k, ref_k)
    torch.testing.assert_close(cache, ref_cache)
