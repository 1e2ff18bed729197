"""The C++ paged attention over the float32 and float16 caches (tinyvllm._cpu) against dense
float64 attention and the torch reference, on ragged contexts, GQA ratios and shuffled block
tables: decode rows, and prefill / mixed batches where every token attends as a row of its own;
the cache writes' float16 rounding against torch's."""

from __future__ import annotations

import math

import pytest
import torch

from tinyvllm import _cpu
from tinyvllm.ops import quantized as q
from tinyvllm.ops.attention import _paged_attention_cpu, paged_attention, paged_attention_ref
from tests.ops.test_references import _build_batch, _dense_causal_attention

pytest.importorskip("tinyvllm._cpu")

ISAS = ["scalar"] + [isa for isa in ("avx2", "avx512vnni") if q.isa_available(isa)]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 32), (5, 5, 24)])
@pytest.mark.parametrize("seq_lens", [[5, 48, 1, 30, 17], [29], [16, 33]])
@pytest.mark.parametrize("block_size", [16, 8])
def test_decode_matches_dense(seq_lens, num_heads, num_kv_heads, head_dim, block_size, threads):
    gen = torch.Generator().manual_seed(len(seq_lens) * 100 + num_heads + block_size)
    seqs = [(1, s) for s in seq_lens]
    query, cache, meta, dense = _build_batch(seqs, num_heads, num_kv_heads, head_dim, block_size,
                                             gen)
    scale = 1 / math.sqrt(head_dim)
    q.set_num_threads(threads)
    try:
        out = _paged_attention_cpu(query, cache, meta, scale)
    finally:
        q.set_num_threads(None)
    for i, (k, v) in enumerate(dense):
        expected = _dense_causal_attention(query[i:i + 1], k, v, scale)
        torch.testing.assert_close(out[i:i + 1].double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(paged_attention(query, cache, meta, scale),
                               paged_attention_ref(query, cache, meta, scale),
                               atol=2e-5, rtol=2e-5)


def test_strided_queries_are_read_in_place():
    """Queries as a view into a wider row (as the rotary op leaves them in the qkv output)."""
    gen = torch.Generator().manual_seed(7)
    query, cache, meta, _ = _build_batch([(1, 20), (1, 3)], 6, 2, 32, 16, gen)
    wide = torch.randn(2, 6 * 32 + 64, generator=gen)
    wide[:, :192] = query.reshape(2, 192)
    view = wide[:, :192].view(2, 6, 32)
    assert not view.is_contiguous()
    torch.testing.assert_close(_paged_attention_cpu(view, cache, meta, 0.2),
                               paged_attention_ref(query, cache, meta, 0.2), atol=2e-5, rtol=2e-5)


def test_block_outside_the_cache_is_refused():
    gen = torch.Generator().manual_seed(8)
    query, cache, meta, _ = _build_batch([(1, 20)], 4, 2, 32, 16, gen)
    meta.block_tables[0, 1] = cache.shape[1] + 5
    with pytest.raises(IndexError, match="block id .* outside the cache"):
        _paged_attention_cpu(query, cache, meta, 0.2)


@pytest.mark.parametrize("seqs", [[(7, 7)], [(1, 30), (5, 21), (16, 40), (1, 1)], [(3, 33), (9, 9)]])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32)])
def test_prefill_and_mixed_batches_match_dense(seqs, num_heads, num_kv_heads, head_dim):
    """(new tokens, context) per sequence: whole prompts, chunks after a cached prefix, decodes."""
    gen = torch.Generator().manual_seed(len(seqs) * 10 + num_heads)
    query, cache, meta, dense = _build_batch(seqs, num_heads, num_kv_heads, head_dim, 16, gen)
    scale = 1 / math.sqrt(head_dim)
    out = _paged_attention_cpu(query, cache, meta, scale)
    qsl = meta.query_start_loc_cpu
    for i, (k, v) in enumerate(dense):
        expected = _dense_causal_attention(query[qsl[i]:qsl[i + 1]], k, v, scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), expected, atol=2e-5,
                                   rtol=2e-5)


def test_a_token_gets_the_same_output_in_any_batch():
    """The last prompt token computed in a whole prefill, and alone after a cached prefix."""
    gen = torch.Generator().manual_seed(11)
    query, cache, meta, _ = _build_batch([(12, 12)], 6, 2, 32, 16, gen)
    whole = _paged_attention_cpu(query, cache, meta, 0.2)
    meta_last = type(meta)(num_tokens=1, slot_mapping=meta.slot_mapping[-1:],
                           query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                           seq_lens=meta.seq_lens, block_tables=meta.block_tables,
                           max_query_len=1, max_seq_len=12, query_start_loc_cpu=[0, 1],
                           seq_lens_cpu=meta.seq_lens_cpu)
    alone = _paged_attention_cpu(query[-1:], cache, meta_last, 0.2)
    assert torch.equal(whole[-1:], alone)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("seqs", [[(1, 5), (1, 48), (1, 1), (1, 30)], [(3, 33), (9, 9), (1, 17)]])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (5, 5, 24)])
def test_float16_cache_matches_the_reference_over_its_values(seqs, num_heads, num_kv_heads,
                                                             head_dim, isa, monkeypatch):
    """A float16 cache is read in place and widened: the same result as float32 attention over
    the widened values (the torch reference, and dense float64)."""
    monkeypatch.setenv("TINYVLLM_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(len(seqs) * 10 + head_dim)
    query, cache, meta, dense = _build_batch(seqs, num_heads, num_kv_heads, head_dim, 16, gen)
    half = cache.to(torch.float16)
    scale = 1 / math.sqrt(head_dim)
    for threads in (1, 2):
        q.set_num_threads(threads)
        try:
            out = paged_attention(query, half, meta, scale)
        finally:
            q.set_num_threads(None)
        torch.testing.assert_close(out, paged_attention_ref(query, half, meta, scale),
                                   atol=2e-5, rtol=2e-5)
    qsl = meta.query_start_loc_cpu
    for i, (k, v) in enumerate(dense):
        widened = (k.half().float(), v.half().float())
        expected = _dense_causal_attention(query[qsl[i]:qsl[i + 1]], *widened, scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), expected, atol=2e-5,
                                   rtol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_float16_rounding_is_torchs(isa):
    """The cache writes' conversion: round to nearest even, overflow to inf, subnormals."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = x[~torch.isnan(x)]
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, -65520.0, 2.0**-24, 2.0**-25,
                          3 * 2.0**-26, 2.0**-14 - 2.0**-25, 1e-9, 0.0, -0.0, math.inf, -math.inf])
    x = torch.cat([x, edges, torch.randn(1001, generator=gen) * 1e3])
    out = torch.empty(x.numel(), dtype=torch.int16)
    _cpu.to_float16(out.data_ptr(), x.data_ptr(), x.numel(), isa)
    assert torch.equal(out, x.to(torch.float16).view(torch.int16))


@pytest.mark.parametrize("isa", ISAS)
def test_float16_rows_do_not_depend_on_the_batch(isa, monkeypatch):
    """A large batch walks each KV head once for its whole query group, a lone row a query head
    at a time: the same values either way."""
    monkeypatch.setenv("TINYVLLM_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(21)
    seqs = [(1, 17 + 5 * i) for i in range(12)]
    query, cache, meta, _ = _build_batch(seqs, 9, 3, 64, 16, gen)
    half = cache.to(torch.float16)
    q.set_num_threads(2)
    try:
        batch = _paged_attention_cpu(query, half, meta, 0.125)
        for i in (0, 7, 11):
            one = type(meta)(num_tokens=1, slot_mapping=meta.slot_mapping[i:i + 1],
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                             seq_lens=meta.seq_lens[i:i + 1],
                             block_tables=meta.block_tables[i:i + 1], max_query_len=1,
                             max_seq_len=seqs[i][1], query_start_loc_cpu=[0, 1],
                             seq_lens_cpu=[seqs[i][1]])
            assert torch.equal(_paged_attention_cpu(query[i:i + 1], half, one, 0.125),
                               batch[i:i + 1])
    finally:
        q.set_num_threads(None)
