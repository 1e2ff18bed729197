"""CUDA paged attention behind `ops.attention.paged_attention`: decode and (chunked) prefill.

Decode (every sequence has one new query) runs the split-K kernel: the context is cut into
partitions so that even a few long sequences fill the GPU, and a second kernel merges them.
`rotary_paged_attention_cuda` is the same launch with the step's new token fused in (rotary,
cache write, attention).
Anything else runs a flash-attention-style prefill kernel: on Hopper (the sm_90a image) the
warpgroup-MMA kernel over a cache of the query's dtype, elsewhere and for an FP8 cache the mma.sync
one. In a mixed batch the leading run of one-token sequences (the scheduler puts running decodes
first) goes to the decode kernel instead: the prefill kernels give every sequence a tile of 64 or
128 query rows and read its K/V once per query head, so a decode row there costs a whole tile's
loads and MMAs for one row. All read a cache of the query's dtype or an FP8 (E4M3) one with
per-layer K/V scales. Under `KernelConfig.batch_invariant` no prefill kernel runs: every new token
attends as a decode row of its own (`_decode_rows`).
"""

from __future__ import annotations

from typing import Optional

import torch

from tinyvllm.config import PREFILL_ATTENTION_KERNELS
from tinyvllm.ops._dispatch import (cuda_ops, dtype_code, kernel_config, sm_count,
                                    stream_handle)
from tinyvllm.ops.attention import AttentionMetadata, DecodePartitions
from tinyvllm.ops.kv_cache import FP8_DTYPE, kv_scale_ptrs

MAX_PARTITION = 512
"""Most tokens per decode partition (the kernel keeps a partition's scores in shared memory)."""

MIN_PARTITION = 64
"""Fewest tokens per decode partition: below this the merge costs more than it saves."""

CTAS_PER_SM = 2
"""Decode launches at least this many CTAs per multiprocessor when partitions allow it."""

PREFILL_KERNELS = {name: code for code, name in enumerate(PREFILL_ATTENTION_KERNELS)}
"""`prefill_kernel` name -> the launcher's code: auto (0) the fastest kernel the device runs,
mma_sync (1) the one every GPU runs (tests and benches compare the two on Hopper)."""


def paged_attention_cuda(kernel, query: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         out: Optional[torch.Tensor] = None,
                         k_scale: Optional[torch.Tensor] = None,
                         v_scale: Optional[torch.Tensor] = None,
                         prefill_kernel: str = "auto",
                         split_decodes: bool = True, *,
                         merge: bool = True, heads_per_cta: int = 0
                         ) -> torch.Tensor | DecodePartitions:
    """Causal attention of new queries over their sequences' paged K/V.

    Args:
        kernel: the `tinyvllm._cuda` module.
        query: [num_tokens, num_heads, head_dim], last dim contiguous.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous, query's dtype
            or FP8_DTYPE.
        meta: block tables, seq_lens and query_start_loc as int32 device tensors.
        scale: softmax scale.
        out: optional contiguous output buffer shaped like query (static buffers, tests).
        k_scale, v_scale: one-element float32 device tensors (None: 1.0), FP8 cache only.
        prefill_kernel: a key of PREFILL_KERNELS (prefill and mixed batches only).
        split_decodes: in a mixed batch, the leading one-token sequences run the decode kernel
            (False: the whole batch runs the prefill kernel; A/B timing).
        merge: False: a pure-decode launch whose context is split returns its unmerged
            DecodePartitions (for `ops.fused_linear`) instead of the output; under
            `KernelConfig.batch_invariant` every launch merges its partitions itself.
        heads_per_cta: query heads of one KV head per decode CTA, 1, 4 or 8 (tests); 0: the
            launcher's choice: 1 where a CTA per (query head, sequence, partition) makes at most
            4 per multiprocessor (a small batch over few partitions), else 4 up to GQA 4 and 8
            above. Each gives the same bits.
    Returns:
        [num_tokens, num_heads, head_dim]; on pure decode only the first num_seqs rows are written.
    """
    _check_inputs(query, kv_cache, meta)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {query.dtype} {tuple(query.shape)} tensor")
    if prefill_kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill_kernel={prefill_kernel!r}: expected one of "
                         f"{sorted(PREFILL_KERNELS)}")
    scales = kv_scale_ptrs(kv_cache, k_scale, v_scale)
    if kernel_config().batch_invariant:
        _decode_rows(kernel, out, query, kv_cache, meta.decode_rows, scale, scales)
        return out
    if meta.max_query_len == 1:
        parts = _decode(kernel, out, query, kv_cache, meta, scale, scales, merge=merge,
                        heads_per_cta=heads_per_cta)
        return out if parts is None else parts
    num_decodes, longest = meta.leading_decodes if split_decodes else (0, 0)
    if num_decodes:
        _decode(kernel, out, query, kv_cache, meta, scale, scales, num_seqs=num_decodes,
                max_seq_len=longest, heads_per_cta=heads_per_cta)
    _prefill(kernel, out, query, kv_cache, meta, scale, scales, PREFILL_KERNELS[prefill_kernel],
             first_seq=num_decodes)
    return out


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    if query.dim() != 3 or query.stride(-1) != 1:
        raise ValueError(f"query: expected [num_tokens, num_heads, head_dim] with a contiguous "
                         f"last dim, got shape {tuple(query.shape)} strides {query.stride()}")
    if (kv_cache.dim() != 5 or not kv_cache.is_contiguous()
            or kv_cache.dtype not in (query.dtype, FP8_DTYPE)):
        raise ValueError(f"kv_cache: expected a contiguous {query.dtype} or {FP8_DTYPE} tensor "
                         f"[2, num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or not t.is_contiguous() or t.device != query.device:
            raise ValueError(f"meta.{name}: expected a contiguous int32 tensor on "
                             f"{query.device}, got {t.dtype} on {t.device}")


_NO_NEW_TOKEN = {"new_key": 0, "new_value": 0, "new_kv_stride": 0, "positions": 0,
                 "slot_mapping": 0, "cos_sin_cache": 0}


_INVARIANT_SPLIT_BYTES = 64 * 1024 * 1024
"""Most bytes of partition outputs one batch-invariant decode launch writes (`_decode_rows`)."""


def _decode_rows(kernel, out, query, kv_cache, rows: AttentionMetadata, scale: float,
                 scales: tuple[int, int]) -> None:
    """`KernelConfig.batch_invariant`: every new token attends as a decode row of its own
    (`AttentionMetadata.decode_rows`: decode, verification and prefill rows alike) in 64-token
    partitions merged in the launch, so that a row's output depends on its own context only. A
    long prefill's rows go in groups whose partitions fit _INVARIANT_SPLIT_BYTES."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    splits = max(2, -(-rows.max_seq_len // MIN_PARTITION))
    group = max(1, _INVARIANT_SPLIT_BYTES // (num_heads * splits * (head_dim + 2) * 4))
    for first in range(0, rows.num_seqs, group):
        # max_seq_len: a graph's context tier, which its captured seq_lens do not show
        _decode(kernel, out[first:], query[first:], kv_cache, rows, scale, scales,
                num_seqs=min(group, rows.num_seqs - first), max_seq_len=rows.max_seq_len,
                first_seq=first)


def _decode(kernel, out, query, kv_cache, meta: AttentionMetadata, scale: float,
            scales: tuple[int, int], new_token: Optional[dict[str, int]] = None,
            merge: bool = True, num_seqs: Optional[int] = None,
            max_seq_len: Optional[int] = None, first_seq: int = 0,
            heads_per_cta: int = 0) -> Optional[DecodePartitions]:
    """new_token: the launcher's arguments of a fused new token (rotary_paged_attention_cuda;
    the keys of _NO_NEW_TOKEN), None for none. merge=False: a split launch leaves its partitions
    unmerged and returns them (out is not written). num_seqs: the first num_seqs sequences only
    (each with one new token, rows 0..num_seqs - 1 of query and out), max_seq_len the longest of
    them (defaults: the whole batch); first_seq: they are the sequences from this one on of
    meta's block tables and seq_lens (query and out start at its row)."""
    num_seqs = meta.num_seqs if num_seqs is None else num_seqs
    max_seq_len = meta.max_seq_len if max_seq_len is None else max_seq_len
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kernel_config().batch_invariant:
        # Every row merges partitions of MIN_PARTITION tokens, whatever the batch, the longest
        # context or the graph's tier: a row's output depends on its own context only.
        partition, num_splits = MIN_PARTITION, max(2, -(-max_seq_len // MIN_PARTITION))
    else:
        partition, num_splits, chosen = decode_partition(num_seqs, num_heads, num_kv_heads,
                                                         max_seq_len, sm_count(query.device))
        heads_per_cta = heads_per_cta or chosen
    split_out = split_max = split_sum = None
    if num_splits > 1:
        split_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                                device=query.device)
        stats = torch.empty((2, num_seqs, num_heads, num_splits), dtype=torch.float32,
                            device=query.device)
        split_max, split_sum = stats[0], stats[1]
    kernel.paged_attention_decode(
        out=out.data_ptr(), query=query.data_ptr(), key_cache=kv_cache[0].data_ptr(),
        value_cache=kv_cache[1].data_ptr(),
        block_tables=meta.block_tables[first_seq:].data_ptr(),
        seq_lens=meta.seq_lens[first_seq:].data_ptr(), split_out=_ptr(split_out),
        split_max=_ptr(split_max), split_sum=_ptr(split_sum), num_seqs=num_seqs,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=kv_cache.shape[2], q_stride_token=query.stride(0),
        q_stride_head=query.stride(1), max_num_blocks_per_seq=meta.block_tables.shape[1],
        num_splits=num_splits, partition_size=partition, scale=scale, k_scale=scales[0],
        v_scale=scales[1], **(new_token or _NO_NEW_TOKEN), merge_splits=int(merge),
        heads_per_cta=heads_per_cta, dtype=dtype_code(query.dtype),
        cache_dtype=dtype_code(kv_cache.dtype), stream=stream_handle(query.device))
    if merge or num_splits == 1:
        return None
    return DecodePartitions(split_out, split_max, split_sum,
                            meta.seq_lens[first_seq:first_seq + num_seqs], partition,
                            query.dtype)


def merge_decode_partitions(parts: DecodePartitions) -> torch.Tensor:
    """DecodePartitions.merge on CUDA: [num_seqs, num_heads, head_dim] in parts.dtype."""
    num_seqs, num_heads, num_splits, head_dim = parts.out.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=parts.dtype, device=parts.out.device)
    cuda_ops().paged_decode_merge(
        out=out.data_ptr(), split_out=parts.out.data_ptr(), split_max=parts.max.data_ptr(),
        split_sum=parts.sum.data_ptr(), seq_lens=parts.seq_lens.data_ptr(), num_seqs=num_seqs,
        num_heads=num_heads, head_dim=head_dim, num_splits=num_splits,
        partition_size=parts.partition_size, dtype=dtype_code(parts.dtype),
        stream=stream_handle(out.device))
    return out


def rotary_paged_attention_cuda(kernel, positions: torch.Tensor, query: torch.Tensor,
                                key: torch.Tensor, value: torch.Tensor,
                                cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                                meta: AttentionMetadata, scale: float,
                                k_scale: Optional[torch.Tensor] = None,
                                v_scale: Optional[torch.Tensor] = None,
                                out: Optional[torch.Tensor] = None, *,
                                merge: bool = True,
                                heads_per_cta: int = 0) -> torch.Tensor | DecodePartitions:
    """Pure decode with the step's new token fused in, one launch: the kernel rotates q and k,
    writes k and v to their slots and attends. query, key and value are read, not modified.
    merge=False: a context split into partitions comes back as its unmerged DecodePartitions.
    heads_per_cta: as for paged_attention_cuda.

    The kernel reads the cached K/V before it waits on the kernel before it (PDL): that kernel
    (in the model, the qkv projection) must not write this cache.

    Shape:
        positions, meta.slot_mapping: [num_seqs] int64 (negative slot: padding, not written)
        query: [num_seqs, num_heads * head_dim]; key, value: [num_seqs, num_kv_heads * head_dim]
            (rows may be strided views into the qkv projection; each row contiguous)
        cos_sin_cache: [max_position, head_dim] float32
        returns: [num_seqs, num_heads, head_dim]
    """
    from tinyvllm.ops.layers_cuda import _check_rotary_tables, _check_rows
    head_dim = cos_sin_cache.shape[-1]
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_rows(name, t)
        if t.shape[0] != meta.num_seqs or t.dtype != query.dtype:
            raise ValueError(f"{name}: expected {query.dtype} [{meta.num_seqs}, ...] (one new "
                             f"token per sequence), got {t.dtype} {tuple(t.shape)}")
    _check_rotary_tables(positions, cos_sin_cache, head_dim, query.device)
    if key.stride(0) != value.stride(0) or key.shape != value.shape:
        raise ValueError(f"key, value: expected the same shape and row stride, got "
                         f"{tuple(key.shape)} / {key.stride(0)} and {tuple(value.shape)} / "
                         f"{value.stride(0)}")
    slots = meta.slot_mapping
    if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] < meta.num_seqs:
        raise ValueError(f"meta.slot_mapping: expected contiguous int64 [{meta.num_seqs}], got "
                         f"{slots.dtype} {tuple(slots.shape)}")
    q = query.view(query.shape[0], -1, head_dim)
    _check_inputs(q, kv_cache, meta)
    if not meta.is_pure_decode:
        raise ValueError("rotary_paged_attention_cuda: decode only (one new token per sequence)")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    new_token = {"new_key": key.data_ptr(), "new_value": value.data_ptr(),
                 "new_kv_stride": key.stride(0), "positions": positions.data_ptr(),
                 "slot_mapping": slots.data_ptr(), "cos_sin_cache": cos_sin_cache.data_ptr()}
    parts = _decode(kernel, out, q, kv_cache, meta, scale,
                    kv_scale_ptrs(kv_cache, k_scale, v_scale), new_token, merge,
                    heads_per_cta=heads_per_cta)
    return out if parts is None else parts


def _prefill(kernel, out, query, kv_cache, meta: AttentionMetadata, scale: float,
             scales: tuple[int, int], prefill_kernel: int = 0, first_seq: int = 0) -> None:
    """Sequences first_seq.. of the batch (their query_start_loc entries stay absolute rows)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    tables = meta.block_tables
    kernel.paged_attention(
        out=out.data_ptr(), query=query.data_ptr(), key_cache=kv_cache[0].data_ptr(),
        value_cache=kv_cache[1].data_ptr(),
        block_tables=tables.data_ptr() + first_seq * tables.stride(0) * tables.element_size(),
        seq_lens=meta.seq_lens.data_ptr() + first_seq * meta.seq_lens.element_size(),
        query_start_loc=(meta.query_start_loc.data_ptr()
                         + first_seq * meta.query_start_loc.element_size()),
        num_seqs=meta.num_seqs - first_seq, num_heads=num_heads, num_kv_heads=kv_cache.shape[3],
        head_dim=head_dim, block_size=kv_cache.shape[2], q_stride_token=query.stride(0),
        q_stride_head=query.stride(1), max_num_blocks_per_seq=meta.block_tables.shape[1],
        max_query_len=meta.max_query_len, scale=scale, k_scale=scales[0], v_scale=scales[1],
        dtype=dtype_code(query.dtype), cache_dtype=dtype_code(kv_cache.dtype),
        prefill_kernel=prefill_kernel, stream=stream_handle(query.device))


ONE_HEAD_CTAS_PER_SM = 16
"""A decode launch runs a CTA per query head (heads_per_cta 1), over partitions chosen for those
CTAs, where that makes at most this many CTAs per multiprocessor. On an H200 (8B heads, us a
launch, cuda/NOTES.md) 16 against 4 took batch 16 x 1000 tokens from 47.4 to 37.7 and 32 x 1000
from 84.4 to 70.8; 32 (batch 64 at one head) lost, 135.6 against 128.4. The launcher's own choice
(`auto_heads_per_cta`, heads_per_cta 0) keeps the partitions it is given and allows 4."""


def decode_partition(num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int,
                     sm_count: int) -> tuple[int, int, int]:
    """(tokens per partition, number of partitions, query heads per CTA) for a decode launch.

    The largest partition that still gives CTAS_PER_SM CTAs per multiprocessor: long contexts of
    a small batch split finely, a large batch keeps whole 512-token partitions. First with a CTA
    per query head, taken where that launch has at most ONE_HEAD_CTAS_PER_SM CTAs a
    multiprocessor (up to batch 32 at 1024 tokens for Llama-3-8B's heads: each warp's work is a
    dependent chain, which four heads make four times as long); else with the CTAs that share a
    KV head's K/V reads (4 query heads a CTA up to GQA 4, 8 above).
    """
    def split(ctas: int) -> tuple[int, int]:
        partition = MAX_PARTITION
        while (partition > MIN_PARTITION
               and ctas * -(-max_seq_len // partition) < CTAS_PER_SM * sm_count):
            partition //= 2
        return partition, max(1, -(-max_seq_len // partition))

    partition, splits = split(num_seqs * num_heads)
    if num_seqs * num_heads * splits <= ONE_HEAD_CTAS_PER_SM * sm_count:
        return partition, splits, 1
    group = num_heads // num_kv_heads
    heads_per_cta = 4 if group <= 4 else 8
    return (*split(num_seqs * num_kv_heads * -(-group // heads_per_cta)), heads_per_cta)


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()
