"""The draft-model proposer: greedy drafts made by the worker after a step's sampling.

The scheduler gives a request `num_lookahead_tokens` = k in a step that samples it (and
allocates KV slots for k positions past the step's); once the step's tokens are known, the
draft model runs k one-token steps from the request's last token, each feeding its argmax to
the next, and the k tokens go back beside the sampled ones (`StepHandle.draft_token_ids`). The
scheduler verifies them in the request's next step like n-gram drafts.

Drafts are the draft's argmax: q is one-hot, as for n-gram drafts, so the acceptance
(`worker/spec_decode.verify`) couples each emitted token to the one plain sampling emits from the
target's logits: the output is the same with speculation on as off, greedy or seeded, and no
draft probabilities travel.

KV cache. The draft's step j writes K/V for the request at position (last token) + j, a slot
the scheduler allocated for the lookahead; every such position is past the request's computed
tokens after the step, so the next verification step writes it again (the target's K/V for
the token that is really there) before anything reads it, and the scheduler frees those slots
when the step is processed (`KVCacheManager.trim`): the draft rolls back with the target.

- Layer-truncated self-draft (`draft_num_layers` = L): the target's first L layers, its final
  norm and head. Those layers see the same inputs for the same tokens as in the target, so their
  K/V are the target's first L layers' K/V: the draft reads and writes the target's own cache
  tensors for them; nothing else to allocate or keep in step.
- A separate draft checkpoint (`model`, the target's vocabulary): its own paged cache, one tensor
  per draft layer sized by the draft's KV heads, indexed by the target's block ids (the block
  tables are the target's). The draft sees every token the target computes: each step's batch
  runs through it too (`catch_up`, right after the target's forward, with the same inputs), so
  its cache holds what the target's does, block for block: prefix-cache hits, preemption and
  the rollback of rejected drafts apply to both.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tinyvllm.config import SpeculativeConfig
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.loader import LoadedModel
from tinyvllm.ops import AttentionMetadata, allocate_kv_caches
from tinyvllm.scheduling.output import DraftTokens, ScheduledRequest
from tinyvllm.worker.cuda_graph import DecodeGraphs
from tinyvllm.worker.input_buffers import InputBuffers
from tinyvllm.worker.requests import CachedRequest


class DraftModelProposer:
    """Runs a draft model's one-token steps over the requests given lookahead slots.

    Args:
        model: the draft (the target itself when truncated).
        kv_caches: the caches of the layers it runs, ops.KV_CACHE_LAYOUT each, indexed by the
            target's block ids.
        num_layers: run only the first num_layers layers (a truncated self-draft); None: all.
        buffers: the runner's input buffers (the draft steps run after the step's forward).
        separate: a model of its own, whose cache `catch_up` must fill with every step's tokens.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                 num_layers: Optional[int], buffers: InputBuffers, block_size: int,
                 separate: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.num_layers = num_layers
        self.buffers = buffers
        self.block_size = block_size
        self.separate = separate
        self.graphs: Optional[DecodeGraphs] = None  # the draft steps' (`capture_graphs`)

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """A separate draft: write its K/V for the step's tokens (the target's batch, the same
        slots). A truncated self-draft's K/V are the target's: nothing to do.

        Shape: input_ids, positions [num_tokens] int64.
        """
        if self.separate:
            self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest],
                records: dict[str, CachedRequest]) -> DraftTokens:
        """Drafts for the step's requests with lookahead slots; their records already hold the
        step's tokens. One host sync, at the end."""
        jobs = sorted(((records[s.request_id], s.num_lookahead_tokens) for s in scheduled
                       if s.num_lookahead_tokens and s.completes_sequence),
                      key=lambda job: -job[1])
        if not jobs:
            return {}
        rows = [r for r, _ in jobs]
        drafted: list[torch.Tensor] = []  # per draft step j: [rows still drafting] int64
        for j in range(jobs[0][1]):
            # Sorted by k, longest first: the rows still drafting are a prefix.
            num_rows = sum(1 for _, k in jobs if k > j)
            drafted.append(self._step(rows[:num_rows], j, drafted[-1] if drafted else None))
        flat = torch.cat(drafted).tolist()
        out: DraftTokens = {r.request_id: [] for r in rows}
        offset = 0
        for step in drafted:
            for r, token in zip(rows, flat[offset:offset + step.shape[0]]):
                out[r.request_id].append(token)
            offset += step.shape[0]
        return out

    def _step(self, rows: list[CachedRequest], j: int,
              prev: Optional[torch.Tensor]) -> torch.Tensor:
        """Draft step j: row i's input is its last token (j = 0) or its previous draft (prev[i],
        copied on the device), at position last + j. Returns the argmax [len(rows)] int64. It
        replays a draft graph when one fits (`capture_graphs`), else runs eagerly."""
        n, bs, b = len(rows), self.block_size, self.buffers
        max_seq_len = max(r.num_tokens for r in rows) + j
        graph = self.graphs.pick(n, max_seq_len) if self.graphs is not None else None
        if graph is not None:
            num_rows, width = graph.batch_size, graph.block_table_width
        else:
            num_rows, width = n, max(r.num_blocks for r in rows)
        b.wait_until_writable()
        b.begin(num_rows, num_rows, width)
        tables = b.block_table_rows(num_rows, width)
        ids, positions, slots = b.input_ids.np, b.positions.np, b.slot_mapping.np
        for i, r in enumerate(rows):
            last = r.num_tokens - 1
            pos = last + j
            table = r.block_table
            tables[i, :min(len(table), width)] = table[:width]  # blocks past pos are unread
            ids[i] = r.token_at(last) if prev is None else 0
            positions[i] = pos
            slots[i] = int(table[pos // bs]) * bs + pos % bs
            b.seq_lens.np[i] = pos + 1
        b.query_start_loc.np[:n + 1] = np.arange(n + 1)
        if num_rows > n:
            b.pad_decode_rows(n, num_rows)
        b.upload()
        if prev is not None:
            b.input_ids.device[:n].copy_(prev[:n])
        if graph is not None:
            return self.graphs.replay(graph)[:n].argmax(dim=-1)
        meta = b.metadata(n, n, width, 1, max_seq_len)
        hidden = self.model(b.input_ids_device(n), b.positions_device(n), self.kv_caches, meta,
                            num_layers=self.num_layers)
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def capture_graphs(self, batch_sizes: list[int], seq_len_tiers: list[int],
                       pool=None):
        """CUDA graphs of the draft steps (a truncated self-draft: the target's first layers over
        their caches). Returns the memory pool they were captured into."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.buffers, batch_sizes,
                                   seq_len_tiers, self.block_size, num_layers=self.num_layers,
                                   name="draft")
        return self.graphs.capture(pool)


def check_draft(spec: SpeculativeConfig, target: LoadedModel,
                draft: Optional[LoadedModel]) -> None:
    """At start, before the KV cache is sized: the draft fits the target.

    Raises:
        ValueError: draft_num_layers outside 1 .. the target's layers, or a draft checkpoint
            whose vocabulary is not the target's (naming the key).
    """
    total = target.arch.num_layers
    if spec.draft_num_layers is not None and not 1 <= spec.draft_num_layers <= total:
        raise ValueError(f"speculative_config.draft_num_layers must be in [1, {total}] (the "
                         f"target's layers), got {spec.draft_num_layers}")
    if draft is not None:
        check_same_vocabulary(target, draft)


def truncated_self_draft(model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                         num_layers: int, buffers: InputBuffers,
                         block_size: int) -> DraftModelProposer:
    """The target's first num_layers layers (`check_draft`ed) over their own cache tensors."""
    return DraftModelProposer(model, kv_caches[:num_layers], num_layers, buffers, block_size)


def separate_draft(draft: LoadedModel, num_blocks: int, block_size: int,
                   kv_cache_dtype: torch.dtype, buffers: InputBuffers,
                   device: torch.device) -> DraftModelProposer:
    """A draft checkpoint (`check_draft`ed) with a cache of its own (`draft_kv_bytes_per_block`
    per block)."""
    rank_arch = getattr(draft.model, "rank_arch", draft.arch)
    caches = allocate_kv_caches(draft.arch.num_layers, num_blocks, block_size,
                                rank_arch.num_kv_heads, draft.arch.head_dim, kv_cache_dtype,
                                device)
    return DraftModelProposer(draft.model, caches, None, buffers, block_size, separate=True)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft token ids must mean the target's tokens: same vocabulary size and EOS ids."""
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config.model: {draft.name} has a vocabulary of "
                         f"{draft.arch.vocab_size} tokens, the target {target.name} "
                         f"{target.arch.vocab_size}; a draft model needs the target's vocabulary")
    draft_eos = set(draft.tokenizer.eos_token_ids)
    if draft_eos != set(target.tokenizer.eos_token_ids):
        raise ValueError(f"speculative_config.model: {draft.name} has EOS ids "
                         f"{sorted(draft_eos)}, the target {sorted(target.tokenizer.eos_token_ids)}"
                         "; a draft model needs the target's vocabulary")


def draft_kv_bytes_per_block(draft: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every draft layer for one block on this rank."""
    a = getattr(draft.model, "rank_arch", draft.arch)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * draft.arch.num_layers * block_size * a.num_kv_heads * a.head_dim * elem
