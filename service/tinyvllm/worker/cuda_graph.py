"""CUDA graphs for pure-decode steps: one graph per (batch-size bucket, context-length tier).

A decode step of a small model is a few hundred short kernels; launching them one by one from
Python costs more than running them. A graph replays the whole forward with one launch.

    batch sizes   [1, 2, 4, 8] + range(16, max_bs + 1, 16), max_bs = min(max_num_seqs, 256)
    context tiers 1024, 4096, ..., min(max_model_len, MAX_SEQ_LEN_TO_CAPTURE)

A step with `num_seqs` sequences (one new token each) whose longest context is `max_seq_len`
replays the smallest graph with batch_size >= num_seqs and tier >= max_seq_len; its rows past
num_seqs are padding (slot -1: no KV write; block table all null block 0; context length 1). The
tier matters because the split-K decode kernel's partition count is fixed at capture by the
metadata's max_seq_len (cuda/NOTES.md): capturing everything at max_model_len would launch
mostly-empty partitions for short contexts. Prefill and mixed steps, larger batches and longer
contexts run eagerly, or, up to `max_piecewise_graph_tokens` tokens, through the piecewise graphs
at the end of this module (everything but the attention).

Verification steps (speculative decoding) are captured too, as decode rows: a request verifying k
drafts becomes k + 1 rows, row j its query at position p + j with a context of p + j + 1 tokens
over the request's block table, so a step of decodes and verifications is a pure-decode batch of
sum(k_b + 1) rows, with the decode kernels and their numerics. Those graphs (`verify=True`) run
with `AttentionMetadata.fuse_new_token` off: every new key is written before any row attends.
The draft steps of a truncated self-draft replay graphs of their own over its first layers
(`num_layers`).

Graphs are captured largest first into one memory pool: a smaller graph's intermediates fit in
what the larger ones freed. All graphs read the runner's persistent input buffers (the layout of
(batch size, batch size, tier width): `InputBuffers.begin`) and write every row's logits (float32)
into one static buffer; sampling runs outside the graph.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from tinyvllm.ops import AttentionMetadata
from tinyvllm.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH_SIZE = 1024
"""Largest decode batch captured (vLLM and nano-vllm go to 512). The default max_num_seqs is 256;
a larger one (`--max-num-seqs 1024`) would otherwise launch every kernel of its decode steps from
Python: at 1,024 SmolLM2 decodes on an H100 host, 12-18 ms of launches a step for 3.9 ms of
kernels (cuda/NOTES.md)."""

COARSE_BATCH_STEP = 64
"""Above 256 rows the buckets are this far apart (at most a fifth of a step padding)."""

MAX_SEQ_LEN_TO_CAPTURE = 8192
"""Longest context a decode graph serves; longer ones run eagerly (vLLM's default too)."""

SEQ_LEN_TIERS = (1024, 4096)
"""Context-length tiers below the cap: short contexts skip most of the cap's partitions."""


@dataclass(frozen=True, order=True)
class GraphKey:
    batch_size: int
    max_seq_len: int  # the tier: contexts up to this many tokens
    block_table_width: int  # ceil(max_seq_len / block_size)
    verify: bool = False  # rows may be positions of one sequence (fuse_new_token off)


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size buckets, ascending; max_bs itself is always one of them."""
    max_bs = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    fine = [1, 2, 4, 8] + list(range(16, 257, 16))
    coarse = list(range(256 + COARSE_BATCH_STEP, max_bs + 1, COARSE_BATCH_STEP))
    sizes = [b for b in fine + coarse if b <= max_bs]
    return sizes if sizes[-1] == max_bs else sizes + [max_bs]


def decode_seq_len_tiers(max_model_len: int) -> list[int]:
    """The context-length tiers, ascending, ending at min(max_model_len, MAX_SEQ_LEN_TO_CAPTURE)."""
    cap = min(max_model_len, MAX_SEQ_LEN_TO_CAPTURE)
    return [t for t in SEQ_LEN_TIERS if t < cap] + [cap]


class DecodeGraphs:
    """Captures and replays the decode graphs of one model over one set of input buffers."""

    def __init__(self, model, kv_caches: list[torch.Tensor], buffers: InputBuffers,
                 batch_sizes: list[int], seq_len_tiers: list[int], block_size: int, *,
                 verify: bool = False, num_layers: Optional[int] = None, name: str = "decode"):
        self.model = model
        self.verify = verify
        self.num_layers = num_layers  # run only the first layers (a truncated self-draft)
        self.name = name
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.batch_sizes = sorted(batch_sizes)
        self.seq_len_tiers = sorted(seq_len_tiers)
        self.block_size = block_size
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.logits: Optional[torch.Tensor] = None  # [max_bs, vocab_size], written by every graph

    def key(self, batch_size: int, max_seq_len: int) -> GraphKey:
        return GraphKey(batch_size, max_seq_len, -(-max_seq_len // self.block_size), self.verify)

    def pick(self, num_rows: int, max_seq_len: int) -> Optional[GraphKey]:
        """The graph for a step of num_rows decode rows, or None when it must run eagerly."""
        bs = next((b for b in self.batch_sizes if b >= num_rows), None)
        tier = next((t for t in self.seq_len_tiers if t >= max_seq_len), None)
        if bs is None or tier is None:
            return None
        return self.key(bs, tier)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every (batch size, tier), largest first, into one memory pool: `pool` (another
        set's, whose graphs never run at the same time as these), else a new one. Returns it."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        device = self.kv_caches[0].device
        self.logits = torch.empty(self.batch_sizes[-1], self.model.arch.vocab_size,
                                  dtype=torch.float32, device=device)
        keys = sorted((self.key(b, t) for b in self.batch_sizes for t in self.seq_len_tiers),
                      reverse=True)
        for bs in reversed(self.batch_sizes):  # warm-up: cuBLAS handles, lazy module loads
            key = self.key(bs, self.seq_len_tiers[-1])
            self.fill_padding(key)
            self._forward(key)
        torch.cuda.synchronize()
        for key in keys:
            self.fill_padding(key)  # also points the buffers at this graph's layout
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(key)
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
        torch.cuda.synchronize()
        logger.info("captured %d %s CUDA graphs (batch sizes %s, context tiers %s) in %.1f s, "
                    "%.0f MiB", len(keys), self.name, self.batch_sizes, self.seq_len_tiers,
                    time.perf_counter() - start, (torch.cuda.memory_reserved() - before) / 2**20)
        return pool

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Run the graph on whatever the input buffers hold. Returns [batch_size, vocab_size]."""
        self.graphs[key].replay()
        return self.logits[:key.batch_size]

    def _forward(self, key: GraphKey) -> None:
        bs = key.batch_size
        b = self.buffers
        layers = {} if self.num_layers is None else {"num_layers": self.num_layers}
        hidden = self.model(b.input_ids_device(bs), b.positions_device(bs), self.kv_caches,
                            self._metadata(key), **layers)
        self.model.compute_logits(hidden, out=self.logits[:bs])

    def _metadata(self, key: GraphKey) -> AttentionMetadata:
        """Capture-time metadata: max_seq_len is the tier, so the kernel's partitioning covers it."""
        bs, width = key.batch_size, key.block_table_width
        b = self.buffers
        return AttentionMetadata(
            num_tokens=bs, slot_mapping=b.slot_mapping.device[:bs],
            query_start_loc=b.query_start_loc.device[:bs + 1], seq_lens=b.seq_lens.device[:bs],
            block_tables=b.block_tables.device[:bs * width].view(bs, width),
            max_query_len=1, max_seq_len=key.max_seq_len,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[key.max_seq_len] * bs,
            fuse_new_token=not key.verify)

    def fill_padding(self, key: GraphKey) -> None:
        """Lay the buffers out for `key` and fill them with padding rows (warm-up and capture
        write nothing to the KV cache)."""
        bs, width = key.batch_size, key.block_table_width
        b = self.buffers
        b.wait_until_writable()
        b.begin(bs, bs, width)
        b.block_table_rows(bs, width)
        b.pad_decode_rows(0, bs)
        b.upload()


_PIECEWISE_SIZES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
"""Token-count buckets of the piecewise graphs: at most half a step of padding."""


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """The buckets up to max_tokens, ascending; max_tokens itself is always the last."""
    sizes = [t for t in _PIECEWISE_SIZES if t < max_tokens]
    return sizes + [max_tokens] if max_tokens > 0 else []


class PiecewiseGraphs:
    """Piecewise CUDA graphs for the steps the decode graphs do not serve (prefill chunks, mixed
    steps of chunks and decodes, decodes past the context tiers): per token-count bucket, one
    graph per piece of the unfused forward between two attentions (`forward_piece`: the
    embedding to layer 0's qkv, then o_proj, MLP, norms and the next layer's qkv, the last ending
    with the final norm). The attention runs eagerly between the pieces over the step's real
    tokens and its own metadata, so a step's shape is free (any mix of prompt chunks, contexts
    and decodes); the pieces are row-wise, so padding rows change nothing of the real rows.

    The pieces read and write static buffers that live outside the graph pool: the token ids,
    the residual stream, the qkv and the attention output [max_tokens, ...]; the step's final
    hidden states land in `hidden`. A step of T tokens replays the bucket's graphs with T real
    rows; its padding rows hold what earlier steps left there (finite values, never read by the
    attention). Steps small enough for the fused decode layers (`uses_fused_decode`) stay eager:
    their layers are five launches already.
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], max_tokens: int):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = piecewise_token_sizes(max_tokens)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._replays: dict[int, list] = {}  # by bucket: its graphs' bound replay methods
        self._fused: dict[int, bool] = {}  # by token count: whether the fused layers serve it
        arch, device = model.rank_arch, kv_caches[0].device
        dtype = model.model.norm.dtype
        qkv = arch.q_size + 2 * arch.kv_size
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.residual = torch.zeros(max_tokens, arch.hidden_size, dtype=dtype, device=device)
        self.qkv = torch.zeros(max_tokens, qkv, dtype=dtype, device=device)
        self.attn = torch.zeros(max_tokens, arch.q_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(max_tokens, arch.hidden_size, dtype=dtype, device=device)
        self.num_pieces = len(model.model.layers) + 1

    def pick(self, num_tokens: int) -> Optional[int]:
        """The bucket of a step of num_tokens tokens, or None when it runs eagerly."""
        size = next((t for t in self.sizes if t >= num_tokens), None)
        if size is None or self.fused(num_tokens) or size not in self.graphs:
            return None
        return size

    def fused(self, num_tokens: int) -> bool:
        fused = self._fused.get(num_tokens)
        if fused is None:
            fused = self._fused[num_tokens] = self.model.uses_fused_decode(
                self.residual[:num_tokens])
        return fused

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every bucket's pieces, largest first, into `pool` (shared with the decode
        graphs: never replayed at the same time); buckets the fused layers serve are skipped.
        Returns the pool."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        sizes = [t for t in reversed(self.sizes) if not self.fused(t)]
        for size in sizes:  # warm-up: cuBLAS handles and algorithm choices for these shapes
            for index in range(self.num_pieces):
                self._piece(index, size)
        torch.cuda.synchronize()
        for size in sizes:
            graphs = []
            for index in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(index, size)
                pool = graph.pool() if pool is None else pool
                graphs.append(graph)
            self.graphs[size] = graphs
            self._replays[size] = [graph.replay for graph in graphs]
        torch.cuda.synchronize()
        logger.info("captured piecewise CUDA graphs for %s tokens (%d pieces each) in %.1f s, "
                    "%.0f MiB", sorted(sizes), self.num_pieces, time.perf_counter() - start,
                    (torch.cuda.memory_reserved() - before) / 2**20)
        return pool

    def _piece(self, index: int, size: int) -> None:
        """Piece `index` over the first `size` rows of the static buffers."""
        model = self.model
        if index == 0:
            x, residual = model.model.embed_tokens(self.input_ids[:size]), None
        else:
            x, residual = self.attn[:size], self.residual[:size]
        out, residual = model.forward_piece(index, x, residual)
        if index + 1 < self.num_pieces:
            self.qkv[:size].copy_(out)
            self.residual[:size].copy_(residual)
        else:
            self.hidden[:size].copy_(out)

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """One step of input_ids [T] in the graphs of bucket `size` (`pick`), the attention of
        each layer between them. Returns the final hidden states [T, hidden_size] (a view of the
        static buffer, valid until the next step)."""
        n = input_ids.shape[0]
        pieces = self._replays.get(size)
        if pieces is None:  # no graphs for the bucket (the CPU tests): the same pieces, eagerly
            pieces = [functools.partial(self._piece, index, size)
                      for index in range(self.num_pieces)]
        self.input_ids[:n].copy_(input_ids)
        pieces[0]()
        qkv, attn, cos_sin_cache = self.qkv[:n], self.attn[:n], self.model.cos_sin_cache
        for layer, kv_cache, piece in zip(self.model.model.layers, self.kv_caches, pieces[1:]):
            attn.copy_(layer.self_attn.attend(positions, qkv, kv_cache, meta, cos_sin_cache))
            piece()
        return self.hidden[:n]
