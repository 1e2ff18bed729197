"""Paged attention over the KV cache: prefill, chunked prefill with cached prefixes, and decode.

The model calls `paged_attention`; the CUDA kernels plug in behind it. Every sequence's new queries
sit at the end of its context: query i of a sequence with `q_len` new tokens and `seq_len` total
tokens is at position `seq_len - q_len + i` and attends (causally) to keys 0..that position, which
live in the blocks listed by its block table (cached prefix blocks included).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from tinyvllm.ops._dispatch import kernel_config, use_kernel
from tinyvllm.ops.kv_cache import CPU_KERNEL_KV_DTYPES, dequantize_kv, kv_dtype_name


@dataclass
class AttentionMetadata:
    """Flat description of one batch; built once per step by the model runner.

    Shape:
        slot_mapping: [num_tokens] int64 (cache slot of each new token; -1 = padding)
        query_start_loc: [num_seqs + 1] int32 (cu_seqlens of the new tokens)
        seq_lens: [num_seqs] int32 (context length including this step's new tokens)
        block_tables: [num_seqs, max_num_blocks_per_seq] int32 (padding entries are 0, the null block)
    Host copies (`*_cpu`) of query_start_loc and seq_lens let the reference loop without syncs.

    fuse_new_token=False: the rows of a pure-decode batch may be consecutive positions of one
    sequence (a verification step laid out as decode rows, `worker/cuda_graph.py`), so every new
    key and value is written before any row attends: the CUDA decode launch that writes a row's
    own token while attending does not run.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    fuse_new_token: bool = True

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def decode_rows(self) -> "AttentionMetadata":
        """The same batch with every new token a decode row of its own: its sequence's block
        table and the context up to and including itself (rows past the last sequence's are
        left out). The step's new K/V must be in the cache before such rows attend
        (fuse_new_token is off). Built once per step, on the block tables' device."""
        if self.is_pure_decode:
            return self
        qsl, num_seqs = self.query_start_loc_cpu, self.num_seqs
        num_rows = qsl[num_seqs]
        q_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(num_seqs)])
        seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
        # row t of a sequence with q new tokens and context L sees L - (q - 1 - t) tokens
        row_in_seq = torch.arange(num_rows) - torch.tensor(qsl[:-1])[seq_of_row]
        seq_lens = (torch.tensor(self.seq_lens_cpu) - q_lens)[seq_of_row] + 1 + row_in_seq
        device = self.block_tables.device
        tables = self.block_tables.index_select(0, seq_of_row.to(device))
        return AttentionMetadata(
            num_tokens=num_rows, slot_mapping=self.slot_mapping[:num_rows],
            query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, device=device),
            seq_lens=seq_lens.to(device=device, dtype=torch.int32), block_tables=tables,
            max_query_len=1, max_seq_len=self.max_seq_len,
            query_start_loc_cpu=list(range(num_rows + 1)), seq_lens_cpu=seq_lens.tolist(),
            fuse_new_token=False)

    @functools.cached_property
    def leading_decodes(self) -> tuple[int, int]:
        """(n, the longest context among them) of the sequences at the head of the batch with one
        new token each. Every layer asks; counted once per step."""
        qsl = self.query_start_loc_cpu
        n = 0
        while n < self.num_seqs and qsl[n + 1] - qsl[n] == 1:
            n += 1
        return n, max(self.seq_lens_cpu[:n], default=0)


@dataclass
class DecodePartitions:
    """A split decode's partitions, not yet merged (`rotary_paged_attention(..., merge=False)` on
    CUDA): each partition's normalised output with its softmax max (log2 domain) and sum.
    `merge()` gives the attention output; `ops.fused_linear` (o_proj) merges them in its prologue
    instead, which saves the merge launch.

    Shape:
        out: [num_seqs, num_heads, num_splits, head_dim] float32
        max, sum: [num_seqs, num_heads, num_splits] float32
        seq_lens: [num_seqs] int32 (a sequence uses ceil(seq_len / partition_size) partitions)
    """

    out: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor
    seq_lens: torch.Tensor
    partition_size: int
    dtype: torch.dtype  # of the merged output

    def merge(self) -> torch.Tensor:
        """The attention output, [num_seqs, num_heads, head_dim] in `dtype` (one launch)."""
        from tinyvllm.ops.attention_cuda import merge_decode_partitions
        return merge_decode_partitions(self)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None, *,
                    merge: bool = True) -> torch.Tensor | DecodePartitions:
    """Causal attention of new queries over their sequences' paged K/V (GQA aware). With
    merge=False a CUDA pure-decode launch whose context is split returns its unmerged
    `DecodePartitions` (for `ops.fused_linear`); everything else returns the output tensor.

    Shape:
        query: [num_tokens, num_heads, head_dim]
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], query's dtype or FP8
        k_scale, v_scale: one-element float32 tensors (None: 1.0), read only for an FP8 cache
        returns: [num_tokens, num_heads, head_dim]
    """
    kernel = use_kernel("paged_attention", query, kv_cache)
    if kernel is not None:
        from tinyvllm.ops.attention_cuda import paged_attention_cuda
        return paged_attention_cuda(kernel, query, kv_cache, meta, scale, k_scale=k_scale,
                                    v_scale=v_scale,
                                    prefill_kernel=kernel_config().prefill_attention_kernel,
                                    split_decodes=kernel_config().split_mixed_attention,
                                    merge=merge)
    if _cpu_kernel_supported(query, kv_cache, meta):
        return _paged_attention_cpu(query, kv_cache, meta, scale)
    return paged_attention_ref(query, kv_cache, meta, scale, k_scale, v_scale)


def _cpu_kernel_supported(query: torch.Tensor, kv_cache: torch.Tensor,
                          meta: AttentionMetadata) -> bool:
    """A float32 batch over a float32 or float16 cache on the CPU runs the C++ kernel
    (tinyvllm._cpu), which reads the paged cache in place instead of gathering every context."""
    from tinyvllm.ops.quantized import cpu_kernels

    return (query.device.type == "cpu" and query.dtype == torch.float32
            and kv_cache.dtype in CPU_KERNEL_KV_DTYPES and kv_cache.is_contiguous()
            and cpu_kernels() is not None and meta.num_seqs > 0)


def _paged_attention_cpu(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float) -> torch.Tensor:
    """Every new token attends as a decode row of its own: its sequence's block table and the
    context up to and including itself (the step's K/V are in the cache already). One kernel
    for decode, prefill and verification rows, so a token's output does not depend on the
    batch it is in or on how much of its prompt came from the prefix cache."""
    from tinyvllm.ops.quantized import cpu_kernels

    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    rows = meta.decode_rows
    num_rows = rows.num_seqs
    tables = rows.block_tables[:num_rows].to(torch.int32).contiguous()  # [num_rows, max_blocks]
    seq_lens = rows.seq_lens[:num_rows].to(torch.int32).contiguous()  # [num_rows]
    q = query[:num_rows]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty_like(query)
    cpu_kernels().paged_decode_attention(
        out.data_ptr(), q.data_ptr(), q.stride(0), kv_cache.data_ptr(), num_blocks, block_size,
        num_kv_heads, head_dim, query.shape[1], tables.data_ptr(), tables.shape[1],
        seq_lens.data_ptr(), num_rows, scale, kv_dtype_name(kv_cache.dtype))
    if out.shape[0] > num_rows:
        out[num_rows:] = 0
    return out


def rotary_paged_attention(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, cos_sin_cache: torch.Tensor,
                           kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None, *,
                           merge: bool = True) -> torch.Tensor | DecodePartitions:
    """`rotary_embedding_and_cache` then `paged_attention`: rotary on the new queries and keys,
    the new keys and values written to their cache slots, attention over the cache.

    On CUDA a pure-decode batch runs as one launch that reads the raw q, k and v; query and key may
    or may not be rotated in place afterwards (the caller treats them as consumed). Without
    `meta.fuse_new_token` (verification rows, which attend to each other's new keys), and for
    every row under `KernelConfig.batch_invariant`, rotary and the cache write are a launch of
    their own before the decode kernel. With merge=False a CUDA decode launch whose context is
    split returns its `DecodePartitions` unmerged (for `ops.fused_linear`); everything else
    returns the output tensor.

    Shape:
        positions, meta.slot_mapping: [num_tokens] int64 (negative slots: padding, not written)
        query: [num_tokens, num_heads * head_dim]; key, value: [num_tokens, num_kv_heads * head_dim]
            (rows may be strided views into a fused qkv output)
        cos_sin_cache: [max_position, head_dim] float32
        kv_cache: KV_CACHE_LAYOUT, query's dtype or FP8 (quantised with the scales)
        returns: [num_tokens, num_heads, head_dim]
    """
    kernel = use_kernel("paged_attention", query, kv_cache)
    if (kernel is not None and meta.is_pure_decode and meta.fuse_new_token
            and not kernel_config().batch_invariant):
        from tinyvllm.ops.attention_cuda import rotary_paged_attention_cuda
        return rotary_paged_attention_cuda(kernel, positions, query, key, value, cos_sin_cache,
                                           kv_cache, meta, scale, k_scale, v_scale, merge=merge)
    from tinyvllm.ops.layers import rotary_embedding_and_cache
    head_dim = cos_sin_cache.shape[-1]
    query, _ = rotary_embedding_and_cache(positions, query, key, value, cos_sin_cache, head_dim,
                                          kv_cache, meta.slot_mapping, k_scale, v_scale)
    return paged_attention(query.reshape(query.shape[0], -1, head_dim), kv_cache, meta, scale,
                           k_scale, v_scale, merge=merge)


def paged_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference: gather each sequence's K/V from its blocks (dequantised), then attend."""
    if meta.is_pure_decode:
        return _decode_batched_ref(query, kv_cache, meta, scale, k_scale, v_scale)
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        q = query[qsl[i]:qsl[i + 1]]
        k, v = _gather_kv(kv_cache, meta.block_tables[i], seq_len)
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        out[qsl[i]:qsl[i + 1]] = _attend(q, k, v, scale, causal_offset=seq_len - q.shape[0])
    return out


def _gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """[seq_len, num_kv_heads, head_dim] keys and values of one sequence."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    kv = kv_cache[:, block_table[:num_blocks].long()]  # [2, nb, bs, hkv, d]
    kv = kv.reshape(2, num_blocks * block_size, *kv_cache.shape[3:])[:, :seq_len]
    return kv[0], kv[1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal_offset: int) -> torch.Tensor:
    """q: [q_len, h, d]; k, v: [kv_len, h_kv, d] of q's dtype; query i sees keys 0..offset + i."""
    q_len, kv_len = q.shape[0], k.shape[0]
    mask = None
    if q_len > 1:
        rows = torch.arange(q_len, device=q.device).unsqueeze(1) + causal_offset
        mask = torch.arange(kv_len, device=q.device).unsqueeze(0) <= rows
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def _decode_batched_ref(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, k_scale: Optional[torch.Tensor],
                        v_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """All sequences have one query: gather every context padded to the longest, mask the rest.

    Written as two batched matmuls with the query heads grouped by KV head, rather than SDPA:
    for one query per sequence on a CPU this is several times cheaper, and K/V are never
    repeated per query head.
    """
    block_size = kv_cache.shape[2]
    num_blocks = -(-meta.max_seq_len // block_size)
    b = meta.num_seqs
    tables = meta.block_tables[:b, :num_blocks].long()  # [b, nb]
    kv = kv_cache[:, tables]  # [2, b, nb, bs, hkv, d]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    kv = kv.reshape(2, b, num_blocks * block_size, num_kv_heads, head_dim)
    k = dequantize_kv(kv[0], k_scale, query.dtype).permute(0, 2, 3, 1)  # [b, hkv, d, ctx]
    v = dequantize_kv(kv[1], v_scale, query.dtype).transpose(1, 2)  # [b, hkv, ctx, d]
    group = query.shape[1] // num_kv_heads
    q = query[:b].reshape(b, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k).mul_(scale).float()  # [b, hkv, group, ctx]
    ctx_len = scores.shape[-1]
    if b > 1 or meta.seq_lens_cpu[0] != ctx_len:
        positions = torch.arange(ctx_len, device=query.device)
        pad = positions.unsqueeze(0) >= meta.seq_lens[:b].unsqueeze(1).to(query.device)
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = torch.matmul(probs, v)  # [b, hkv, group, d]
    result = torch.empty_like(query)
    result[:b] = out.reshape(b, num_kv_heads * group, head_dim)
    return result
