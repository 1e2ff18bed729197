"""CUDA paged attention (decode split-K and chunked prefill) against the torch reference, over
caches of the query's dtype and FP8 (E4M3) caches with K/V scales."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tinyvllm.ops import attention_cuda
from tinyvllm.ops._dispatch import cuda_ops
from tinyvllm.ops.attention import (AttentionMetadata, DecodePartitions, paged_attention,
                                    paged_attention_ref, rotary_paged_attention)
from tinyvllm.ops.kv_cache import FP8_DTYPE, quantize_kv, reshape_and_cache_ref
from tinyvllm.ops.layers import build_cos_sin_cache, rotary_embedding_and_cache_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK_SIZE = 16
POISON = 1.0e4  # finite garbage in unused cache slots: a wrong mask shows up as a huge error
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}
HEADS = [(9, 3), (32, 8), (12, 1), (4, 4), (20, 2)]  # GQA 3, 4, 12 (two CTAs), MHA, 10
FP8_SCALES = (0.37, 0.009)  # K, V: the largest V values (~N(0, 1) / 0.009) saturate at +-448


def every_variant(test):
    """Parametrize over cache kind, dtype, head size and head layout."""
    for mark in reversed([
            pytest.mark.parametrize("kv", ["same", "fp8"]),
            pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"]),
            pytest.mark.parametrize("head_dim", [64, 128]),
            pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")]):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def kernels():
    module = cuda_ops()
    assert module is not None and hasattr(module, "paged_attention"), "tinyvllm._cuda not built"
    return module


def make_batch(seqs, num_heads, num_kv_heads, head_dim, dtype, seed, fp8=False):
    """Random paged batch on the GPU. seqs: list of (q_len, seq_len); blocks shuffled.

    With fp8 the cache is FP8 written with FP8_SCALES (poison saturates to 448 * scale); returns
    (query, cache, meta, (k_scale, v_scale)) then, else (query, cache, meta).
    """
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 5  # null block 0 and spares
    cache = torch.full((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), POISON, dtype=dtype)
    scales = None
    if fp8:
        scales = tuple(torch.tensor(s) for s in FP8_SCALES)
        cache = torch.stack([quantize_kv(cache[0], scales[0]), quantize_kv(cache[1], scales[1])])
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), max(blocks_per_seq) + 3, dtype=torch.int32)
    all_slots, new_slots = [], []
    for i, ((q_len, seq_len), nb) in enumerate(zip(seqs, blocks_per_seq)):
        tables[i, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                 for p in range(seq_len)]
        all_slots += slots
        new_slots += slots[seq_len - q_len:]
    total = len(all_slots)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    reshape_and_cache_ref(k, v, cache, torch.tensor(all_slots), *(scales or ()))
    q_lens = [q for q, _ in seqs]
    seq_lens = [s for _, s in seqs]
    cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    meta = AttentionMetadata(
        num_tokens=cu[-1], slot_mapping=torch.tensor(new_slots, device=dev),
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=cu, seq_lens_cpu=seq_lens)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen).to(dtype)
    if fp8:
        return query.to(dev), cache.to(dev), meta, tuple(s.to(dev) for s in scales)
    return query.to(dev), cache.to(dev), meta


def check_against_reference(kernels, seqs, heads, head_dim, dtype, seed, fp8=False,
                            prefill_kernel="auto"):
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    num_heads, num_kv_heads = heads
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, dtype, seed, fp8)
    query, cache, meta = batch[:3]
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(query, float("nan"))  # poison: every row must be written
    if fp8:  # the reference dequantises the same FP8 cache to float32
        k_scale, v_scale = batch[3]
        paged_attention_cuda(kernels, query, cache, meta, scale, out=out, k_scale=k_scale,
                             v_scale=v_scale, prefill_kernel=prefill_kernel)
        ref = paged_attention_ref(query.float(), cache, meta, scale, k_scale, v_scale)
    else:
        paged_attention_cuda(kernels, query, cache, meta, scale, out=out,
                             prefill_kernel=prefill_kernel)
        ref = paged_attention_ref(query.float(), cache.float(), meta, scale)
    rows = meta.num_seqs if meta.max_query_len == 1 else meta.num_tokens
    out, ref = out[:rows].float(), ref[:rows]
    assert torch.isfinite(out).all(), "unwritten or non-finite output rows"
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= REL_TOL[dtype], f"relative error {rel:.2e}"
    return out


DECODE_CASES = {
    "ragged": [(1, 5), (1, 48), (1, 1), (1, 30), (1, 17)],
    "one_long": [(1, 2049)],  # small batch: many short partitions, merged by the reduce kernel
    "many_mixed": [(1, n) for n in (600, 33, 1, 511, 512, 513, 1000, 77) * 5],
    "many_short": [(1, 1 + (7 * i) % 300) for i in range(40)],  # one partition per sequence
}


@every_variant
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_reference(kernels, case, heads, head_dim, dtype, kv):
    seed = hash((case, heads, head_dim, str(dtype))) % 2**31
    check_against_reference(kernels, DECODE_CASES[case], heads, head_dim, dtype, seed,
                            fp8=kv == "fp8")


PREFILL_CASES = {
    # prefill, chunked prefill over a cached prefix, a decode row, q and key tile boundaries
    # (64 and 128 rows, 64 and 128 keys), a chunk whose second warpgroup has rows and one whose
    # first warpgroup finishes its keys tiles before the second
    "ragged": [(7, 7), (3, 41), (1, 17), (20, 33), (65, 65), (70, 200)],
    "long": [(300, 1000), (129, 129)],
    "one_row_tiles": [(2, 2), (2, 64), (2, 65)],
    "key_tiles": [(128, 128), (129, 257), (200, 200), (256, 385), (1, 129)],
    # leading decodes run the decode kernel, the rest the prefill kernel (a decode after a
    # prefill included)
    "decodes_first": [(1, 300), (1, 17), (1, 1000), (1, 1), (64, 64), (3, 41), (1, 9)],
    "long_decodes_first": [(1, 2049)] * 3 + [(200, 700)],
}


@every_variant
@pytest.mark.parametrize("prefill_kernel", ["auto", "mma_sync"])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_reference(kernels, case, prefill_kernel, heads, head_dim, dtype, kv):
    """"auto" is the wgmma kernel on Hopper (same-dtype caches), so both kernels are checked."""
    seed = hash((case, heads, head_dim, str(dtype), "prefill")) % 2**31
    check_against_reference(kernels, PREFILL_CASES[case], heads, head_dim, dtype, seed,
                            fp8=kv == "fp8", prefill_kernel=prefill_kernel)


def test_unknown_prefill_kernel_raises(kernels):
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    query, cache, meta = make_batch([(5, 40)], 8, 2, 128, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="prefill_kernel='wgmma'"):
        paged_attention_cuda(kernels, query, cache, meta, 0.1, prefill_kernel="wgmma")


def test_public_op_dispatches_to_kernel(kernels):
    query, cache, meta = make_batch([(5, 40), (1, 9)], 8, 2, 128, torch.bfloat16, seed=3)
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    direct = paged_attention_cuda(kernels, query, cache, meta, 0.1)
    torch.testing.assert_close(paged_attention(query, cache, meta, 0.1), direct, rtol=0, atol=0)


def test_strided_query_from_fused_qkv(kernels):
    """q as a view into a [num_tokens, (h + 2 h_kv) * d] projection output."""
    query, cache, meta = make_batch([(9, 50), (4, 4)], 8, 2, 64, torch.float16, seed=5)
    qkv = torch.randn(query.shape[0], (8 + 4) * 64, device="cuda", dtype=torch.float16)
    qkv[:, :8 * 64] = query.reshape(query.shape[0], -1)
    strided = qkv[:, :8 * 64].view(query.shape[0], 8, 64)
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    torch.testing.assert_close(paged_attention_cuda(kernels, strided, cache, meta, 0.125),
                               paged_attention_cuda(kernels, query, cache, meta, 0.125),
                               rtol=0, atol=0)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_unsupported_head_dim_raises(kernels, decode):
    seqs = [(1, 20)] if decode else [(4, 20)]
    query, cache, meta = make_batch(seqs, 4, 2, 96, torch.bfloat16, seed=1)
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    with pytest.raises(ValueError, match="head_dim=96"):
        paged_attention_cuda(kernels, query, cache, meta, 0.1)


@pytest.mark.parametrize("seqs", [[(1, 700), (1, 33)], [(6, 90), (1, 12)]], ids=["decode", "mixed"])
def test_cuda_graph_replay_sees_new_inputs(kernels, seqs):
    """Captured once, replayed after the query changes in place (how the model runner uses it)."""
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    query, cache, meta = make_batch(seqs, 8, 2, 128, torch.bfloat16, seed=11)
    out = torch.empty_like(query)
    paged_attention_cuda(kernels, query, cache, meta, 0.1, out=out)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_cuda(kernels, query, cache, meta, 0.1, out=out)
    query.copy_(torch.randn_like(query))
    out.fill_(float("nan"))
    graph.replay()
    expected = paged_attention_cuda(kernels, query, cache, meta, 0.1)
    rows = meta.num_seqs if meta.max_query_len == 1 else meta.num_tokens
    torch.testing.assert_close(out[:rows], expected[:rows], rtol=0, atol=0)


@pytest.mark.parametrize("seqs", [[(1, 700), (1, 33)], [(6, 90), (1, 12)]], ids=["decode", "mixed"])
def test_fp8_graph_replay_sees_updated_scales(kernels, seqs):
    """The scales are read through pointers: a graph captured once uses values set later."""
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    query, cache, meta, (k_scale, v_scale) = make_batch(seqs, 8, 2, 128, torch.bfloat16, 13,
                                                        fp8=True)
    out = torch.empty_like(query)
    run = lambda: paged_attention_cuda(kernels, query, cache, meta, 0.1, out=out,  # noqa: E731
                                       k_scale=k_scale, v_scale=v_scale)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    k_scale.fill_(0.05)
    v_scale.fill_(3.0)
    out.fill_(float("nan"))
    graph.replay()
    expected = paged_attention_ref(query.float(), cache, meta, 0.1, k_scale, v_scale)
    rows = meta.num_seqs if meta.max_query_len == 1 else meta.num_tokens
    rel = ((out[:rows].float() - expected[:rows]).norm() / expected[:rows].norm()).item()
    assert rel <= REL_TOL[torch.bfloat16], f"relative error {rel:.2e}"


def test_fp8_cache_with_wrong_query_dtype_raises(kernels):
    query, cache, meta, _ = make_batch([(1, 20)], 4, 2, 64, torch.bfloat16, seed=2, fp8=True)
    from tinyvllm.ops.attention_cuda import paged_attention_cuda
    with pytest.raises(ValueError, match="kv_cache"):
        paged_attention_cuda(kernels, query, cache.view(torch.uint8), meta, 0.1)


# ---- decode with the step's new token fused in (rotary + cache write + attention) ----------------

FUSED_CASES = {
    "ragged": [(1, 5), (1, 48), (1, 1), (1, 30), (1, 17)],
    "one_long": [(1, 2049)],
    "very_long": [(1, 9000)],
    "many_short": [(1, 1 + (7 * i) % 300) for i in range(40)],
}


def make_new_tokens(meta, num_heads, num_kv_heads, head_dim, dtype, seed):
    """qkv rows of the step (q, k, v as strided views, like the model's split), the positions and
    a Llama 3 scaled rotary table."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(meta.num_seqs, q_size + 2 * kv_size, generator=gen, device="cuda").to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = meta.seq_lens.long() - 1
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cos_sin = build_cos_sin_cache(head_dim, 10000, 500000.0, scaling, device="cuda")
    return qkv, (q, k, v), positions, cos_sin


def stale_new_slots(cache, meta):
    """NaN (16-bit) or 0x7f (E4M3 NaN) in the new tokens' slots: reading them before the fused write
    poisons the output."""
    flat = cache.view(2, -1, *cache.shape[3:])
    slots = meta.slot_mapping[meta.slot_mapping >= 0]
    if cache.dtype == FP8_DTYPE:
        flat.view(torch.uint8)[:, slots] = 0x7F
    else:
        flat[:, slots] = float("nan")


@every_variant
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_rotary_decode_matches_separate_ops(kernels, case, heads, head_dim, dtype, kv):
    """One launch against rotary_embedding_and_cache + paged attention: same cache bytes (up to
    a rounding of the rotation), same output, and against the float32 reference."""
    num_heads, num_kv_heads = heads
    seed = hash((case, heads, head_dim, str(dtype), "fused")) % 2**31
    batch = make_batch(FUSED_CASES[case], num_heads, num_kv_heads, head_dim, dtype, seed,
                       fp8=kv == "fp8")
    query, cache, meta = batch[:3]
    k_scale, v_scale = batch[3] if kv == "fp8" else (None, None)
    stale_new_slots(cache, meta)
    qkv, (q, k, v), positions, cos_sin = make_new_tokens(meta, num_heads, num_kv_heads, head_dim,
                                                         dtype, seed)
    scale = 1 / math.sqrt(head_dim)
    fused_cache, qkv_before = cache.clone(), qkv.clone()
    out = torch.full((meta.num_seqs, num_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    attention_cuda.rotary_paged_attention_cuda(kernels, positions, q, k, v, cos_sin, fused_cache,
                                               meta, scale, k_scale, v_scale, out=out)
    assert torch.equal(qkv, qkv_before), "the fused kernel must not modify q, k, v"

    sep_cache, sep_qkv = cache.clone(), qkv.clone()
    sq, sk, sv = sep_qkv.split([q.shape[1], k.shape[1], v.shape[1]], dim=-1)
    sq, _ = kernels_rotary_and_cache(positions, sq, sk, sv, cos_sin, head_dim, sep_cache, meta,
                                     k_scale, v_scale)
    separate = paged_attention(sq.reshape(meta.num_seqs, num_heads, head_dim), sep_cache, meta,
                               scale, k_scale, v_scale)
    if kv == "fp8":  # a rounding apart in the rotation may move an E4M3 value by one step
        diff = (fused_cache.view(torch.uint8).int() - sep_cache.view(torch.uint8).int()).abs()
        assert (diff <= 1).all() and (diff > 0).float().mean() < 1e-3
    else:
        torch.testing.assert_close(fused_cache, sep_cache, rtol=1e-2, atol=1e-2, equal_nan=True)
        assert torch.equal(fused_cache.isnan(), sep_cache.isnan())
    assert torch.isfinite(out).all(), "unwritten rows, or a stale slot was read"
    rel = ((out.float() - separate.float()).norm() / separate.float().norm()).item()
    assert rel <= 2e-3, f"fused vs separate kernels: relative error {rel:.2e}"

    # float32 reference: rotary in float, cache writes (the FP8 cache: the separate kernels'),
    # gather-then-attend
    ref_cache = sep_cache if kv == "fp8" else cache.float()
    ref_q, _ = rotary_embedding_and_cache_ref(positions, q.float(), k.float(), v.float(), cos_sin,
                                              head_dim, ref_cache if kv != "fp8" else cache.clone(),
                                              meta.slot_mapping, k_scale, v_scale)
    ref = paged_attention_ref(ref_q.view(meta.num_seqs, num_heads, head_dim), ref_cache, meta,
                              scale, k_scale, v_scale)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel <= REL_TOL[dtype], f"relative error {rel:.2e}"


def kernels_rotary_and_cache(positions, q, k, v, cos_sin, head_dim, cache, meta, k_scale, v_scale):
    from tinyvllm.ops.layers import rotary_embedding_and_cache
    return rotary_embedding_and_cache(positions, q, k, v, cos_sin, head_dim, cache,
                                      meta.slot_mapping, k_scale, v_scale)


def test_rotary_decode_padding_rows_write_nothing(kernels):
    """Graph padding rows (slot -1, a context of 1 in the null block) attend but never write."""
    query, cache, meta = make_batch([(1, 40), (1, 7)], 8, 2, 64, torch.bfloat16, seed=17)
    meta.slot_mapping[1] = -1
    _, (q, k, v), positions, cos_sin = make_new_tokens(meta, 8, 2, 64, torch.bfloat16, 17)
    before = cache.clone()
    out = rotary_paged_attention(positions, q, k, v, cos_sin, cache, meta, 0.125)
    assert torch.isfinite(out).all()
    changed = (cache != before).view(2, -1, 2 * 64).any(dim=(0, 2)).nonzero().flatten().tolist()
    assert changed == [int(meta.slot_mapping[0])]


def test_rotary_decode_graph_replay_sees_new_inputs(kernels):
    """Captured once; replayed after qkv and positions change in place (the model runner's use)."""
    _, cache, meta = make_batch([(1, 700), (1, 33)], 8, 2, 128, torch.bfloat16, seed=19)
    qkv, (q, k, v), positions, cos_sin = make_new_tokens(meta, 8, 2, 128, torch.bfloat16, 19)
    out = torch.empty(2, 8, 128, dtype=torch.bfloat16, device="cuda")
    run = lambda c: attention_cuda.rotary_paged_attention_cuda(  # noqa: E731
        kernels, positions, q, k, v, cos_sin, c, meta, 0.1, out=out)
    run(cache.clone())
    torch.cuda.synchronize()
    graph_cache = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(graph_cache)
    qkv.copy_(torch.randn_like(qkv))
    positions.sub_(3)
    graph_cache.copy_(cache)
    out.fill_(float("nan"))
    graph.replay()
    got, got_cache = out.clone(), graph_cache.clone()
    eager_cache = cache.clone()
    run(eager_cache)
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    torch.testing.assert_close(got_cache, eager_cache, rtol=0, atol=0)


def test_rotary_decode_rejects_prefill(kernels):
    _, cache, meta = make_batch([(3, 20)], 4, 2, 64, torch.bfloat16, seed=2)
    qkv = torch.randn(3, 8 * 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([256, 128, 128], dim=-1)
    cos_sin = build_cos_sin_cache(64, 100, 10000.0, None, device="cuda")
    with pytest.raises(ValueError, match="one new token per sequence"):
        attention_cuda.rotary_paged_attention_cuda(kernels, torch.arange(3, device="cuda"), q, k,
                                                   v, cos_sin, cache, meta, 0.1)


@pytest.mark.parametrize("kv", ["same", "fp8"])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((32, 8), 128), ((20, 2), 128)],
                         ids=["smollm2", "8b", "gqa10"])
def test_decode_heads_per_cta_give_the_same_bits(kernels, heads, head_dim, kv):
    """A CTA per query head (the launcher's choice for a small batch) and a CTA per 4 or 8 heads
    of a KV head (larger batches) compute each head alike: the same output bits, fused new token
    or not, split contexts or not, and the same cache writes."""
    num_heads, num_kv_heads = heads
    batch = make_batch([(1, 2049), (1, 70), (1, 1), (1, 300)], num_heads, num_kv_heads, head_dim,
                       torch.bfloat16, seed=31, fp8=kv == "fp8")
    query, cache, meta = batch[:3]
    k_scale, v_scale = batch[3] if kv == "fp8" else (None, None)
    _, (q, k, v), positions, cos_sin = make_new_tokens(meta, num_heads, num_kv_heads, head_dim,
                                                       torch.bfloat16, 31)
    plain, fused = {}, {}
    for heads_per_cta in (1, 4, 8):
        out = torch.full_like(query, float("nan"))
        attention_cuda.paged_attention_cuda(kernels, query, cache, meta, 0.1, out=out,
                                            k_scale=k_scale, v_scale=v_scale,
                                            heads_per_cta=heads_per_cta)
        plain[heads_per_cta] = out
        written = cache.clone()
        fused[heads_per_cta] = (attention_cuda.rotary_paged_attention_cuda(
            kernels, positions, q, k, v, cos_sin, written, meta, 0.1, k_scale, v_scale,
            heads_per_cta=heads_per_cta), written)
    assert torch.isfinite(plain[1]).all() and torch.isfinite(fused[1][0]).all()
    for heads_per_cta in (4, 8):
        torch.testing.assert_close(plain[heads_per_cta], plain[1], rtol=0, atol=0)
        for got, want in zip(fused[heads_per_cta], fused[1]):
            torch.testing.assert_close(got.view(torch.uint8), want.view(torch.uint8), rtol=0,
                                       atol=0)


def test_decode_rejects_other_heads_per_cta(kernels):
    query, cache, meta = make_batch([(1, 40)], 8, 2, 64, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="heads_per_cta=3 must be 0"):
        attention_cuda.paged_attention_cuda(kernels, query, cache, meta, 0.1, heads_per_cta=3)


@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((32, 8), 128)], ids=["smollm2", "8b"])
def test_rotary_decode_unmerged_partitions(kernels, heads, head_dim):
    """merge=False: a split launch leaves its partitions, and merging them gives the merged
    launch's output bit for bit (same cache writes); a launch that does not split returns the
    output itself."""
    num_heads, num_kv_heads = heads
    _, cache, meta = make_batch([(1, 2049), (1, 70), (1, 1)], num_heads, num_kv_heads, head_dim,
                                torch.bfloat16, seed=23)
    _, (q, k, v), positions, cos_sin = make_new_tokens(meta, num_heads, num_kv_heads, head_dim,
                                                       torch.bfloat16, 23)
    # Decode rows (q, k and v read as the strided views they are), then verification rows
    # (fuse_new_token off: rotary rotates q and k in place and the cache write launches first,
    # so each run takes copies), whose decode kernel's partitions come back unmerged all the same.
    for step_meta in (meta, dataclasses.replace(meta, fuse_new_token=False)):
        fresh = ((lambda: (q, k)) if step_meta.fuse_new_token
                 else (lambda: (q.clone(), k.clone())))
        run = lambda c, merge: rotary_paged_attention(  # noqa: E731
            positions, *fresh(), v, cos_sin, c, step_meta, 0.1, merge=merge)
        merged_cache, parts_cache = cache.clone(), cache.clone()
        out = run(merged_cache, True)
        parts = run(parts_cache, False)
        assert isinstance(parts, DecodePartitions) and parts.out.shape[2] > 1
        assert torch.equal(parts_cache, merged_cache)
        assert torch.equal(parts.merge(), out)

    _, cache, meta = make_batch([(1, 40)] * 100, num_heads, num_kv_heads, head_dim,
                                torch.bfloat16, seed=29)  # enough CTAs: one partition each
    _, (q, k, v), positions, cos_sin = make_new_tokens(meta, num_heads, num_kv_heads, head_dim,
                                                       torch.bfloat16, 29)
    out = rotary_paged_attention(positions, q, k, v, cos_sin, cache, meta, 0.1, merge=False)
    assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize("case", ["ragged", "decodes_first", "long_decodes_first"])
@pytest.mark.parametrize("heads", [(9, 3), (32, 8)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_batch_invariant_rows_equal_each_token_alone(kernels, case, heads, monkeypatch):
    """Under batch_invariant a prefill or mixed batch attends every new token as a decode row
    (`AttentionMetadata.decode_rows`): each row's output is the same bits as that token alone in
    a one-row decode launch over a longer context tier (a graph's), and within the reference's
    tolerance; rows go in groups when their partitions are large."""
    from tinyvllm import ops
    from tinyvllm.config import KernelConfig

    num_heads, num_kv_heads = heads
    query, cache, meta = make_batch(PREFILL_CASES[case], num_heads, num_kv_heads, 128,
                                    torch.bfloat16, seed=hash((case, heads)) % 2**31)
    scale = 128 ** -0.5
    ops.configure(KernelConfig(batch_invariant=True))
    try:
        out = torch.full_like(query, float("nan"))
        attention_cuda.paged_attention_cuda(kernels, query, cache, meta, scale, out=out)
        ref = paged_attention_ref(query.float(), cache.float(), meta, scale)
        assert ((out.float() - ref).norm() / ref.norm()).item() <= REL_TOL[torch.bfloat16]
        rows = meta.decode_rows
        for r in range(rows.num_seqs):
            one = AttentionMetadata(
                num_tokens=1, slot_mapping=rows.slot_mapping[r:r + 1],
                query_start_loc=rows.query_start_loc[:2], seq_lens=rows.seq_lens[r:r + 1],
                block_tables=rows.block_tables[r:r + 1], max_query_len=1,
                max_seq_len=4096, query_start_loc_cpu=[0, 1],
                seq_lens_cpu=rows.seq_lens_cpu[r:r + 1], fuse_new_token=False)
            alone = attention_cuda.paged_attention_cuda(kernels, query[r:r + 1], cache, one,
                                                        scale)
            assert torch.equal(alone, out[r:r + 1]), f"row {r}"
        monkeypatch.setattr(attention_cuda, "_INVARIANT_SPLIT_BYTES", 1 << 16)  # groups
        grouped = attention_cuda.paged_attention_cuda(kernels, query, cache, meta, scale)
        assert torch.equal(grouped, out)
    finally:
        ops.configure(KernelConfig())
