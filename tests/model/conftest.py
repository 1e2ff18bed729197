"""Running a model over the paged cache without the engine: one or more sequences, any step."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tinyvllm import ops

BLOCK_SIZE = 16


class PagedRun:
    """Sequences with fixed block tables (block 0 is the null block) over fresh KV caches."""

    def __init__(self, model, max_seq_len: int, num_seqs: int = 1,
                 kv_dtype: Optional[torch.dtype] = None) -> None:
        arch, weight = model.rank_arch, next(model.parameters())  # this rank's KV heads
        blocks_per_seq = -(-max_seq_len // BLOCK_SIZE)
        self.model = model
        self.kv_caches = ops.allocate_kv_caches(
            arch.num_layers, 1 + num_seqs * blocks_per_seq, BLOCK_SIZE, arch.num_kv_heads,
            arch.head_dim, kv_dtype or weight.dtype, weight.device)
        self.block_tables = 1 + torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(
            num_seqs, blocks_per_seq)

    def step(self, chunks: list[tuple[list[int], int]]) -> torch.Tensor:
        """chunks[i] = (new token ids of sequence i, number already computed); -> logits of every
        new token, [num_tokens, vocab]."""
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for i, (new_ids, start) in enumerate(chunks):
            for p in range(start, start + len(new_ids)):
                slots.append(int(self.block_tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE
                             + p % BLOCK_SIZE)
                positions.append(p)
            ids += new_ids
            cu.append(cu[-1] + len(new_ids))
            seq_lens.append(start + len(new_ids))
        meta = ops.AttentionMetadata(
            num_tokens=len(ids), slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.block_tables[:len(chunks)],
            max_query_len=max(len(c) for c, _ in chunks), max_seq_len=max(seq_lens),
            query_start_loc_cpu=cu, seq_lens_cpu=seq_lens)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            return self.model.compute_logits(hidden)


@pytest.fixture
def paged_run():
    """`paged_run(model, max_seq_len, num_seqs=1) -> PagedRun`."""
    return PagedRun
