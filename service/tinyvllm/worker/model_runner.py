"""ModelRunner: turns a SchedulerOutput into flat tensors, runs the model, samples.

It makes no policy decisions: which tokens to compute was decided by the scheduler. It owns the
model, the paged KV cache (one tensor per layer, layout `ops.KV_CACHE_LAYOUT`), the persistent
input buffers (`input_buffers.py`), the decode CUDA graphs (`cuda_graph.py`), and per-request
sampling state (seeded generators) for as long as a request runs. The same code runs on the CPU,
where the "device" buffers are the host arrays themselves and no graph is captured.
"""

from __future__ import annotations

import contextlib

import logging
from dataclasses import dataclass
from operator import attrgetter
from typing import Optional, Sequence

import numpy as np
import torch

from tinyvllm.config import CacheConfig, EngineConfig
from tinyvllm.distributed import get_tp
from tinyvllm.scheduling.output import ScheduledRequest, SchedulerOutput
from tinyvllm.model.loader import LoadedModel, load_model
from tinyvllm.ops import AttentionMetadata, allocate_kv_caches, fused_linear_supported
from tinyvllm.ops._dispatch import configure, cuda_ops, device_support
from tinyvllm.ops.quantized import configure_cpu_threads, cpu_kernels
from tinyvllm.ops.kv_cache import FP8_DTYPE, kv_dtype_name, resolve_kv_cache_dtype
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.draft_model import (DraftModelProposer, check_draft,
                                         draft_kv_bytes_per_block, separate_draft,
                                         truncated_self_draft)
from tinyvllm.worker.cuda_graph import (DecodeGraphs, GraphKey, PiecewiseGraphs,
                                        decode_batch_sizes,
                                        decode_seq_len_tiers)
from tinyvllm.worker.input_buffers import InputBuffers
from tinyvllm.worker.prompt_logprobs import (PromptLogprobsJob, StepPromptLogprobs,
                                             compute_prompt_logprobs, plan_job)
from tinyvllm.worker.requests import (CachedRequest, RequestRecords, apply_scheduler_output,
                                      prompt_logprobs_due)
from tinyvllm.worker.sampler import Sampler, SamplingState
from tinyvllm.worker.spec_decode import PendingVerification
from tinyvllm.scheduling.output import SampledTokens
from tinyvllm.worker.step_handle import StepHandle

logger = logging.getLogger(__name__)

_GIB = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """"auto": CUDA when torch sees a device, else the CPU. A bare "cuda" is the current device
    (a tensor-parallel worker has set its own) with its index."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device: cuda was asked for but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class ModelInputs:
    """One step's inputs, already queued for the device (views into the persistent buffers)."""

    num_tokens: int
    meta: Optional[AttentionMetadata]  # None when a CUDA graph runs the step
    graph: Optional[GraphKey]
    logits_indices: torch.Tensor  # [num_logit_rows] int64: rows of the tokens to sample from
    sampled_requests: list[CachedRequest]
    # Per sampled request, its draft tokens (speculative decoding; empty for the others). A
    # request with k drafts has k + 1 logits rows: its last token's and each draft's position.
    draft_token_ids: list[list[int]]
    # Requests with prompt logprobs and their prompt rows in this step (usually none).
    prompt_jobs: list[PromptLogprobsJob]
    # A step of decodes: each sampled request's length before its token (its seq_lens row).
    sampled_lengths: Optional[list[int]] = None

    @property
    def has_drafts(self) -> bool:
        return any(self.draft_token_ids)


_num_computed_tokens = attrgetter("num_computed_tokens")
_completes_sequence = attrgetter("completes_sequence")
_draft_token_ids = attrgetter("draft_token_ids")
_request_id = attrgetter("request_id")
_row = attrgetter("row")
_num_blocks = attrgetter("num_blocks")
_sampling = attrgetter("sampling")
_output_token_ids = attrgetter("output_token_ids")

_ARRAY_MIN_ROWS = 256
"""A step of decodes with fewer rows finds its in-flight inputs by the loop (`_last_tokens`):
numpy's cost per call outweighs the loop's per row below about this many."""

_IDS_RING_SIZE = 3
"""Pinned buffers for sampled ids in rotation: at most two steps are unread at once (async)."""


@dataclass
class _PrevSampled:
    """The last launched step's sampled ids, kept on the device for the next step's inputs."""

    token_ids: torch.Tensor  # [num_sampled] int64 (a verification's: every row's, flat)
    # request id -> (row in token_ids, that token's position in the sequence); a verification's
    # last token, for a step scheduled behind it that assumes every draft accepted. A plain
    # step's is made from `requests` and `lengths` on first use (`by_request_id`).
    rows: Optional[dict[str, tuple[int, int]]] = None
    # A plain step: its sampled records, row i's sample in token_ids[i], at position lengths[i].
    requests: Sequence[CachedRequest] = ()
    lengths: Sequence[int] = ()

    def by_request_id(self) -> dict[str, tuple[int, int]]:
        if self.rows is None:
            self.rows = dict(zip(map(_request_id, self.requests),
                                 zip(range(len(self.requests)), self.lengths)))
        return self.rows

    def by_table_row(self, table_rows: np.ndarray, num_table_rows: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """A plain step's samples of the records whose `BlockTables` rows are table_rows (of
        num_table_rows): each one's row in token_ids and that token's position, -1 for none.
        A record keeps its table row while it lives, but a row freed since may be a new
        record's: the caller compares each position with its own."""
        sampled_rows = np.fromiter(map(_row, self.requests), np.intp, len(self.requests))
        inverse = np.full(num_table_rows, -1, dtype=np.intp)
        inverse[sampled_rows] = np.arange(len(sampled_rows))
        src = inverse[table_rows]
        positions = np.asarray(self.lengths, dtype=np.int64)[src]
        positions[src < 0] = -1
        return src, positions


def keep_gguf_packed(dequantize: Optional[bool], device: torch.device) -> bool:
    """`--[no-]dequantize`: GGUF blocks stay packed by default on the CPU, on a GPU when asked."""
    return dequantize is False or (dequantize is None and device.type == "cpu")


class ModelRunner:
    """Owns the model, the KV cache, the input buffers and (on CUDA) the decode graphs.

    A step: host arrays filled from the SchedulerOutput -> one non-blocking copy into the device
    buffers -> (async scheduling) input ids of decodes whose token the previous step sampled,
    copied on the device from its samples -> forward and logits (one graph replay for pure-decode
    batches that fit a bucket, else eager, then the logits of the completed sequences) -> sampler
    -> non-blocking copy of the sampled ids to pinned host memory. `execute_async` returns
    without a host sync; the step's one sync is `StepHandle.result()`.
    """

    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None,
                 draft_loaded: Optional[LoadedModel] = None):
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        configure(config.kernel)  # the kernel choices, for this process's ops
        if self.device.type == "cuda":
            device_support()  # checks the GPU once; warns about kernels that cannot run on it
        if self.device.type == "cpu":
            configure_cpu_threads(config.model.threads)
        # Refused before the load; "auto" moves only on the CPU (below).
        self._check_kv_cache_dtype(resolve_kv_cache_dtype(config.cache.kv_cache_dtype,
                                                          self.dtype))
        self.loaded = loaded or load_model(config.model.model, self.dtype, self.device,
                                           seed=config.model.seed,
                                           packed=keep_gguf_packed(config.model.dequantize,
                                                                   self.device),
                                           quantization=config.model.quantization)
        self.model = self.loaded.model
        self.arch = self.loaded.arch
        self._check_batch_invariant()
        fused_cpu_step = (self.device.type == "cpu" and cpu_kernels() is not None
                          and getattr(self.model, "packed_decoder", None) is not None)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype,
                                                     fused_cpu_step)
        # A separate draft checkpoint (speculative_config.model; tests may pass one loaded).
        self.draft_loaded = draft_loaded or self._load_draft()
        check_draft(config.speculative, self.loaded, self.draft_loaded)
        # This rank's shape: its KV heads are the ones its cache holds (tensor parallelism).
        self.rank_arch = getattr(self.model, "rank_arch", self.arch)
        self.tp = get_tp()
        self.max_model_len = min(config.model.max_model_len or self.loaded.max_model_len,
                                 self.loaded.max_model_len)
        self.block_size = config.cache.block_size
        memory_gib = (torch.cuda.get_device_properties(self.device).total_memory / _GIB
                      if self.device.type == "cuda" else 0.0)
        # The step sizes, unset ones chosen for this device; the engine's scheduler takes these.
        self.scheduler_config = sched = config.scheduler.for_device(self.device.type, memory_gib)
        self.max_num_tokens = sched.max_num_batched_tokens
        self.max_num_seqs = sched.max_num_seqs
        self.use_cuda_graphs = self.device.type == "cuda" and not config.model.enforce_eager
        longest = max(self.max_model_len, self.max_num_tokens)  # the profile run is one sequence
        max_blocks = -(-longest // self.block_size)
        self.buffers = InputBuffers(self.max_num_tokens, self.max_num_seqs, max_blocks,
                                    self.device)
        self.sampler = Sampler()
        self.requests = RequestRecords(max_blocks)  # what the scheduler has told us of
        self._prev_sampled: Optional[_PrevSampled] = None
        self._ids_ring: list[torch.Tensor] = []
        self.num_blocks = self._determine_num_blocks(config.cache)
        self.kv_caches = allocate_kv_caches(
            self.arch.num_layers, self.num_blocks, self.block_size, self.rank_arch.num_kv_heads,
            self.arch.head_dim, self.kv_cache_dtype, self.device)
        self.drafter = self._make_drafter()
        # A separate draft runs every step's batch after the target (`catch_up`), which the
        # decode graphs do not capture: its steps run eagerly.
        self.graphs = self.verify_graphs = self.piecewise = None
        if self.use_cuda_graphs and self.draft_loaded is None:
            self._capture_graphs()
        logger.info("KV cache: %d blocks of %d tokens on %s (%s, %d bytes per block)",
                    self.num_blocks, self.block_size, self.device,
                    kv_dtype_name(self.kv_cache_dtype), self.kv_bytes_per_block())

    def _check_batch_invariant(self) -> None:
        """`--batch-invariant` on CUDA holds only where every projection and the head run the
        tensor-core GEMV at any row count: refused at start otherwise, naming what it lacks."""
        if (not self.config.kernel.batch_invariant or self.device.type != "cuda"
                or cuda_ops() is None):
            return
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"batch_invariant on CUDA needs dtype bfloat16 or float16 (its "
                             f"kernels take 16-bit activations), got {self.dtype}")
        # Past one 16-row chunk: under batch invariance `use_fused_decode` takes 16-bit weights
        # at every row count and packed ones at none.
        probe = torch.zeros(17, self.arch.hidden_size, dtype=self.dtype, device=self.device)
        serves = getattr(self.model, "uses_fused_decode", None)
        head = getattr(self.model, "lm_head", None)
        head_weight = getattr(self.model, "lm_head_weight", None)
        if (serves is None or not serves(probe)
                or (head is not None and not isinstance(head, torch.nn.Linear))
                or not isinstance(head_weight, torch.Tensor)
                or not fused_linear_supported(probe, head_weight)):
            raise ValueError(
                "batch_invariant: this model's projections do not all run the tensor-core GEMV "
                "(16-bit weights, k a multiple of 64 and n of 16; packed quantized weights do "
                f"not), so its outputs would still depend on the batch (quantization: "
                f"{self.config.model.quantization or 'from the checkpoint'}); run without it")

    def _check_kv_cache_dtype(self, kv_dtype: torch.dtype) -> None:
        """The CUDA kernels read a cache of the queries' dtype or FP8 (with 16-bit queries)."""
        if self.device.type != "cuda" or cuda_ops() is None:
            return
        name = self.config.cache.kv_cache_dtype
        if kv_dtype == FP8_DTYPE and self.dtype == torch.float32:
            raise ValueError("kv_cache_dtype: fp8 on CUDA needs dtype bfloat16 or float16 "
                             "(the attention kernels take 16-bit queries), got float32")
        if kv_dtype != FP8_DTYPE and kv_dtype != self.dtype:
            raise ValueError(f"kv_cache_dtype: {name} on CUDA needs the model dtype {name} (the "
                             f"attention kernels read a cache of the queries' dtype or fp8), got "
                             f"dtype {kv_dtype_name(self.dtype)}")

    def _make_drafter(self) -> Optional[DraftModelProposer]:
        """The draft-model proposer (`--speculative-config` method draft_model), else None."""
        spec = self.config.speculative
        if not spec.uses_draft_model:
            return None
        if spec.draft_num_layers is not None:
            return truncated_self_draft(self.model, self.kv_caches, spec.draft_num_layers,
                                        self.buffers, self.block_size)
        return separate_draft(self.draft_loaded, self.num_blocks, self.block_size,
                              self.kv_cache_dtype, self.buffers, self.device)

    def _load_draft(self) -> Optional[LoadedModel]:
        spec = self.config.speculative
        if not spec.uses_draft_model or spec.model is None:
            return None
        return load_model(spec.model, self.dtype, self.device, seed=self.config.model.seed,
                          packed=self.device.type == "cpu" and not self.config.model.dequantize)

    def _capture_graphs(self) -> None:
        """The decode graphs; with speculation, the verification graphs (decodes and
        verifications as decode rows) up to the batch at which speculation steps aside, and the
        truncated self-draft's own."""
        # A decode batch has at most max_num_seqs rows and max_num_batched_tokens tokens.
        tiers = decode_seq_len_tiers(self.max_model_len)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.buffers,
                                   decode_batch_sizes(min(self.max_num_seqs, self.max_num_tokens)),
                                   tiers, self.block_size)
        pool = self.graphs.capture()
        pool = self._capture_piecewise(pool)
        spec = self.config.speculative
        if not spec.enabled:
            return
        seqs = min(self.max_num_seqs, spec.disable_by_batch_size or self.max_num_seqs)
        rows = min(seqs * (spec.num_speculative_tokens + 1), self.max_num_tokens)
        self.verify_graphs = DecodeGraphs(self.model, self.kv_caches, self.buffers,
                                          decode_batch_sizes(rows), tiers, self.block_size,
                                          verify=True, name="verification")
        pool = self.verify_graphs.capture(pool)
        if self.drafter is not None:
            self.drafter.capture_graphs(decode_batch_sizes(seqs), tiers, pool)

    def _capture_piecewise(self, pool):
        """The piecewise graphs of the steps the decode graphs miss, up to
        max_piecewise_graph_tokens tokens; none under batch invariance (a step padded to its
        bucket would change its GEMMs' row counts)."""
        max_tokens = min(self.config.model.max_piecewise_graph_tokens, self.max_num_tokens)
        if max_tokens <= 0 or self.config.kernel.batch_invariant:
            return pool
        self.piecewise = PiecewiseGraphs(self.model, self.kv_caches, max_tokens)
        return self.piecewise.capture(pool)

    # --- sizing ---------------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """K and V of every layer for one block on this rank (a separate draft model's layers
        included: its cache has as many blocks); an FP8 cache has 1-byte elements (half of
        bf16)."""
        a = self.rank_arch
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        draft = (0 if self.draft_loaded is None else
                 draft_kv_bytes_per_block(self.draft_loaded, self.block_size, self.kv_cache_dtype))
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * elem + draft

    def _determine_num_blocks(self, cache: CacheConfig) -> int:
        """Blocks of the KV cache; with tensor parallelism the smallest any rank can hold (one
        block id names the same slot on every rank)."""
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.device.type != "cuda":
            num_blocks = max(2, int(cache.kv_cache_memory_gb * _GIB) // self.kv_bytes_per_block())
        else:
            num_blocks = self._profile_num_blocks(cache)
        return self.tp.min_int(num_blocks) if self.tp.size > 1 else num_blocks

    def _profile_num_blocks(self, cache: CacheConfig) -> int:
        """Run the largest step once, then give the KV cache what the budget leaves.

        budget = total * gpu_memory_utilization, spent on
            torch's peak during the largest step (weights, activations, logits and sampler of
                max_num_seqs rows)
          + memory outside torch's allocator (CUDA context, cuBLAS workspaces, other libraries)
          + the CUDA graph pool, bounded by the step's activation peak (graphs capture after the
                KV cache exists, so they cannot reuse what the profile run freed)
          + the KV cache: the rest.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        self._dummy_run(self.max_num_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        graph_reserve = peak - resident if self.use_cuda_graphs else 0
        torch.cuda.empty_cache()
        available = total * cache.gpu_memory_utilization - peak - outside_torch - graph_reserve
        num_blocks = int(available) // self.kv_bytes_per_block()
        logger.info("memory profile: peak %.2f GiB (weights and buffers %.2f), outside torch "
                    "%.2f, graph reserve %.2f, KV cache %.2f GiB of %.1f", peak / _GIB,
                    resident / _GIB, outside_torch / _GIB, graph_reserve / _GIB,
                    max(0, num_blocks) * self.kv_bytes_per_block() / _GIB, total / _GIB)
        if num_blocks < 2:
            raise RuntimeError(
                f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves no room for the KV "
                f"cache (peak use {peak / _GIB:.1f} GiB of {total / _GIB:.1f} GiB)")
        return num_blocks

    @torch.inference_mode()
    def _dummy_run(self, num_tokens: int) -> None:
        """One sequence of num_tokens tokens over a throwaway cache, then logits and a top-k/top-p
        sample of min(max_num_seqs, num_tokens) rows: the largest step's memory."""
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        caches = allocate_kv_caches(self.arch.num_layers, num_blocks + 1, bs,
                                    self.rank_arch.num_kv_heads, self.arch.head_dim,
                                    self.kv_cache_dtype, self.device)
        b = self.buffers
        b.wait_until_writable()
        b.begin(num_tokens, 1, num_blocks)
        b.input_ids.np[:num_tokens] = 0
        b.positions.np[:num_tokens] = np.arange(num_tokens) % self.max_model_len
        b.slot_mapping.np[:num_tokens] = np.arange(bs, bs + num_tokens)  # block 0 stays null
        b.query_start_loc.np[:2] = (0, num_tokens)
        b.seq_lens.np[0] = num_tokens
        b.block_table_rows(1, num_blocks)[0] = np.arange(1, num_blocks + 1)
        b.upload()
        meta = b.metadata(num_tokens, 1, num_blocks, num_tokens, num_tokens)
        hidden = self.model(b.input_ids_device(num_tokens), b.positions_device(num_tokens), caches,
                            meta)
        rows = min(self.max_num_seqs, num_tokens)
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
        states = [SamplingState(params, [0], []) for _ in range(rows)]
        self.sampler(self.model.compute_logits(hidden[-rows:]), states)
        del caches, hidden

    # --- one step -------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> SampledTokens:
        """Run one step and wait for its sampled tokens."""
        return self.execute_async(out).result()

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        """Launch one step (inputs, forward, logits, sampling) without waiting for it; with
        draft-model speculation, wait for it and draft (`StepHandle.draft_token_ids`) when the
        scheduler gave lookahead slots: the drafts start from the step's tokens, and the
        scheduler does not schedule ahead while a request could speculate."""
        with self._torch_ops_inline():
            handle = self._launch(out)
        if self.drafter is not None and any(s.num_lookahead_tokens for s in out.scheduled):
            handle.result()  # the records now hold the step's tokens (cached for the engine)
            handle.draft_token_ids = self.drafter.propose(out.scheduled, self.requests)
        return handle

    @contextlib.contextmanager
    def _torch_ops_inline(self):
        """On the CPU with the fused packed step, the step's heavy work runs on the kernels' pool
        and torch's remaining ops (sampling, logits processing) on one thread: torch's OpenMP
        threads spin after each parallel op (libgomp's default) on the cores the kernels run on
        next, which cost a batched run about 10% and a batch-1 decode step about 15%."""
        if self.device.type != "cpu" or getattr(self.model, "packed_decoder", None) is None:
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput) -> StepHandle:
        rows = apply_scheduler_output(self.requests, out, self.device)
        if rows is None:
            return StepHandle.done()
        inputs = self._prepare_inputs(out, rows)
        logits, token_rows = self._forward(inputs)
        prompt = self._prompt_logprobs(inputs, token_rows) if inputs.prompt_jobs else None
        requests = inputs.sampled_requests
        self._prev_sampled = None
        on_cuda = self.device.type == "cuda"
        if not requests:
            if prompt is None:
                return StepHandle.done()
            return StepHandle.launch([], [], None, prompt=prompt, on_cuda=on_cuda)
        # Each sampled request's length before its first token of this step (the position
        # that token takes): a result is appended only where the record still has that length
        # (a step scheduled behind a verification that fell short is dropped).
        lengths = (inputs.sampled_lengths if inputs.sampled_lengths is not None else
                   [len(r.prompt_token_ids) + r.sampling.output_index for r in requests])
        if inputs.has_drafts:
            pending = PendingVerification(logits, requests, inputs.draft_token_ids, self.sampler,
                                          self.tp, lengths, self._next_ids_buffer())
            if self.tp.size > 1:  # its broadcast now, while every rank is in this step
                return StepHandle.finished(pending.result(), prompt)
            self._prev_sampled = _PrevSampled(*pending.last_tokens())
            return StepHandle.deferred(pending.result, prompt, on_cuda)
        states = list(map(_sampling, requests))
        sampled = self.sampler.sample(logits, states)
        if self.tp.size > 1:  # every rank keeps rank 0's tokens (random rows may differ)
            self.tp.broadcast(sampled.token_ids, src=0)
        self._prev_sampled = _PrevSampled(sampled.token_ids, None, requests, lengths)
        return StepHandle.launch(requests, states, sampled, self._next_ids_buffer(), prompt,
                                 on_cuda, lengths)

    def _next_ids_buffer(self) -> Optional[torch.Tensor]:
        """Pinned host memory for a step's sampled ids, from a ring of _IDS_RING_SIZE: the engine
        reads a step's result before it launches the step after next, so a buffer is free again
        by the time the ring comes back to it (a fresh pinned tensor costs ~50 us of host time)."""
        if self.device.type != "cuda":
            return None
        if not self._ids_ring:  # a verification step has a token id per row
            size = max(self.max_num_seqs, self.max_num_tokens)
            self._ids_ring = [torch.empty(size, dtype=torch.int64, pin_memory=True)
                              for _ in range(_IDS_RING_SIZE)]
        self._ids_ring.append(self._ids_ring.pop(0))
        return self._ids_ring[-1]

    def _forward(self, inputs: ModelInputs) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """Logits [num_sampled, vocab_size] float32 of the step's sampled rows (None: none), and
        every token's row for prompt logprobs: the hidden states [num_tokens, hidden_size] of an
        eager step, the logits [num_rows, vocab_size] of a graph replay."""
        num_sampled = len(inputs.sampled_requests)
        if inputs.graph is not None:
            graphs = self.verify_graphs if inputs.graph.verify else self.graphs
            logits = graphs.replay(inputs.graph)  # every row's, padding included
            # Decode row i samples at logits row i: when every row samples, a slice will do.
            if inputs.logits_indices.shape[0] == inputs.num_tokens:
                return logits[:inputs.num_tokens], logits
            return (logits[inputs.logits_indices] if num_sampled else None), logits
        b = self.buffers
        input_ids = b.input_ids_device(inputs.num_tokens)
        positions = b.positions_device(inputs.num_tokens)
        size = self.piecewise.pick(inputs.num_tokens) if self.piecewise is not None else None
        if size is not None:  # all but the attention in graphs
            hidden = self.piecewise.run(size, input_ids, positions, inputs.meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, inputs.meta)
        if self.drafter is not None:
            self.drafter.catch_up(input_ids, positions, inputs.meta)
        if not num_sampled:
            return None, hidden
        return self.model.compute_logits(hidden[inputs.logits_indices]), hidden

    def _prompt_logprobs(self, inputs: ModelInputs, token_rows: torch.Tensor
                         ) -> StepPromptLogprobs:
        """Score the step's prompt rows (`_forward`'s second result), a piece at a time."""
        if inputs.graph is not None:
            def row_logits(first: int, end: int) -> torch.Tensor:
                return token_rows[first:end]
        else:
            def row_logits(first: int, end: int) -> torch.Tensor:
                return self.model.compute_logits(token_rows[first:end])
        return compute_prompt_logprobs(inputs.prompt_jobs, row_logits, self.arch.vocab_size,
                                       self.device)

    def _prepare_inputs(self, out: SchedulerOutput, rows: list[CachedRequest]) -> ModelInputs:
        scheduled = out.scheduled
        num_seqs, num_tokens = len(scheduled), out.num_scheduled_tokens
        if num_seqs > self.max_num_seqs or num_tokens > self.max_num_tokens:
            raise ValueError(f"step of {num_seqs} sequences / {num_tokens} tokens exceeds "
                             f"max_num_seqs={self.max_num_seqs} / "
                             f"max_num_batched_tokens={self.max_num_tokens}")
        # A step of one token per request (each has at least one): the decode path's starts.
        starts = list(map(_num_computed_tokens, scheduled)) if num_tokens == num_seqs else None
        max_seq_len = (max(starts) + 1 if starts is not None else
                       max(s.num_computed_tokens + s.num_new_tokens for s in scheduled))
        graph = None
        if self.graphs is not None and num_tokens == num_seqs:  # one new token each: pure decode
            graph = self.graphs.pick(num_seqs, max_seq_len)
        elif self.verify_graphs is not None and all(
                s.completes_sequence and s.num_new_tokens == len(s.draft_token_ids) + 1
                for s in scheduled):  # decodes and verifications: one decode row per token
            graph = self.verify_graphs.pick(num_tokens, max_seq_len)
        if graph is not None:
            num_rows, width = graph.batch_size, graph.block_table_width
        else:
            num_rows, width = num_seqs, max(map(_num_blocks, rows))
        b = self.buffers
        b.wait_until_writable()
        b.begin(max(num_tokens, num_rows), num_rows, width)
        tables = b.block_table_rows(num_rows, width)
        decodes = (starts is not None and all(map(_completes_sequence, scheduled))
                   and not prompt_logprobs_due(rows))
        if decodes:
            sampled, num_prev, num_logit_rows, prompt_jobs = self._fill_host_decodes(
                scheduled, rows, tables, starts)
        else:
            sampled, num_prev, num_logit_rows, prompt_jobs = self._fill_host(
                scheduled, rows, tables)
        if graph is not None and graph.verify and num_tokens > num_seqs:
            self._spread_into_token_rows(scheduled, num_tokens, num_rows, width)
        if num_rows > num_tokens:
            b.pad_decode_rows(num_tokens, num_rows)
        b.upload()
        if num_prev:
            b.fill_prev_token_ids(num_prev, self._prev_sampled.token_ids)
        meta = None
        if graph is None:
            max_query_len = 1 if starts is not None else max(s.num_new_tokens for s in scheduled)
            meta = b.metadata(num_tokens, num_seqs, width, max_query_len, max_seq_len)
        return ModelInputs(num_tokens=num_tokens, meta=meta, graph=graph,
                           logits_indices=b.logits_indices_device(num_logit_rows),
                           sampled_requests=sampled,
                           draft_token_ids=(
                               list(map(_draft_token_ids, scheduled)) if decodes else
                               [s.draft_token_ids for s in scheduled if s.completes_sequence]),
                           prompt_jobs=prompt_jobs,
                           sampled_lengths=b.seq_lens.np[:num_seqs].tolist() if decodes else None)

    def _spread_into_token_rows(self, scheduled: list[ScheduledRequest], num_tokens: int,
                                num_rows: int, width: int) -> None:
        """A step of decodes and verifications as decode rows (`cuda_graph.py`): token t of a
        request becomes a row with the request's block table and a context ending at t's
        position. `_fill_host` wrote one row per request; ids, positions and slots are per token
        already."""
        b = self.buffers
        counts = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, len(scheduled))
        owner = np.repeat(np.arange(len(scheduled)), counts)
        tables = b.block_tables.np[:num_rows * width].reshape(num_rows, width)
        tables[:num_tokens] = tables[owner]  # the right side is a copy
        b.seq_lens.np[:num_tokens] = b.positions.np[:num_tokens] + 1
        b.query_start_loc.np[:num_tokens + 1] = np.arange(num_tokens + 1)

    def _fill_host_decodes(self, scheduled: list[ScheduledRequest], records: list[CachedRequest],
                           tables: np.ndarray, starts: Optional[list[int]] = None
                           ) -> tuple[list[CachedRequest], int, int, list[PromptLogprobsJob]]:
        """`_fill_host` for a step of decodes only (one token each, every one sampled, no
        prompt logprobs): the per-request values gathered in lists or arrays, each array
        written once. starts: the requests' num_computed_tokens, where the caller has them."""
        bs = self.block_size
        b = self.buffers
        n = len(scheduled)
        if starts is None:
            starts = list(map(_num_computed_tokens, scheduled))
        positions = b.positions.np[:n]
        positions[:] = starts
        pool, rows = self._gather_tables(records, tables)
        prompt_lens = self.requests.tables.prompt_lens[rows]
        # The sampled token's index in the output: a seeded row's Philox offset (the others
        # draw a fresh seed, so theirs is never read in a decode step).
        if self.requests.num_seeded:
            for state, index in zip(map(_sampling, records),
                                    (positions + 1 - prompt_lens).tolist()):
                state.output_index = index
        num_prev = self._queue_in_flight_tokens(records, positions, prompt_lens, rows)
        if num_prev is None:  # some input known on the host (or a verification in flight)
            ids, num_prev = self._last_tokens(records, starts, range(n))
            b.input_ids.np[:n] = ids
        b.slot_mapping.np[:n] = pool[rows, positions // bs] * bs + positions % bs
        b.query_start_loc.np[:n + 1] = np.arange(n + 1)
        b.seq_lens.np[:n] = b.positions.np[:n] + 1
        b.logits_indices.np[:n] = np.arange(n)
        return list(records), num_prev, n, []

    def _fill_host(self, scheduled: list[ScheduledRequest], records: list[CachedRequest],
                   tables: np.ndarray
                   ) -> tuple[list[CachedRequest], int, int, list[PromptLogprobsJob]]:
        """Write token ids, positions, slots, offsets, lengths and block tables of the batch into
        the host buffers. Returns the requests whose last position is sampled, in row order, how
        many input ids are left to fill from the previous step's samples (prev_token_*), the
        number of logits rows (a speculative request has one per position), and the prompt rows
        to score for prompt logprobs."""
        bs = self.block_size
        b = self.buffers
        ids, positions, slots = b.input_ids.np, b.positions.np, b.slot_mapping.np
        qsl, seq_lens, logits_idx = b.query_start_loc.np, b.seq_lens.np, b.logits_indices.np
        qsl[0] = offset = num_logit_rows = 0
        sampled: list[CachedRequest] = []
        prompt_jobs: list[PromptLogprobsJob] = []
        decodes: list[CachedRequest] = []  # rows whose first token is the request's last one
        decode_starts: list[int] = []
        decode_offsets: list[int] = []
        self._gather_tables(records, tables)
        for i, (s, r) in enumerate(zip(scheduled, records)):
            n, start = s.num_new_tokens, s.num_computed_tokens
            table = r.block_table
            if n == 1 or s.draft_token_ids:  # a decode: its last token (below)
                decodes.append(r)
                decode_starts.append(start)
                decode_offsets.append(offset)
            if n == 1:  # scalar writes, no numpy temporaries
                positions[offset] = start
                slots[offset] = int(table[start // bs]) * bs + start % bs
            else:
                pos = np.arange(start, start + n)
                if s.draft_token_ids:  # then the drafts to verify
                    ids[offset + 1:offset + n] = s.draft_token_ids
                else:
                    ids[offset:offset + n] = r.token_slice(start, start + n)
                positions[offset:offset + n] = pos
                slots[offset:offset + n] = table[pos // bs].astype(np.int64) * bs + pos % bs
            if r.prompt_logprobs_pos < r.prompt_logprobs_end:
                job = plan_job(r, start, n, offset)
                if job is not None:
                    prompt_jobs.append(job)
            offset += n
            qsl[i + 1] = offset
            seq_lens[i] = start + n
            if s.completes_sequence:
                num_rows = len(s.draft_token_ids) + 1
                logits_idx[num_logit_rows:num_logit_rows + num_rows] = np.arange(
                    offset - num_rows, offset)
                num_logit_rows += num_rows
                sampled.append(r)
                # The (first) token sampled here sits at position start + n - num_rows + 1.
                r.sampling.output_index = start + n - num_rows + 1 - r.num_prompt_tokens
        last, num_prev = self._last_tokens(decodes, decode_starts, decode_offsets)
        ids[decode_offsets] = last
        return sampled, num_prev, num_logit_rows, prompt_jobs

    def _gather_tables(self, records: list[CachedRequest], tables: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
        """The step's block tables, row i = records[i]'s first `tables.shape[1]` entries (a
        graph's width covers the step's contexts; lookahead blocks past them are unread), in one
        gather from the records' `BlockTables`. Returns that array and the records' rows in it."""
        rows = np.fromiter(map(_row, records), np.intp, len(records))
        pool = self.requests.tables.array
        tables[:len(records)] = pool[rows, :tables.shape[1]]
        return pool, rows

    def _queue_in_flight_tokens(self, records: list[CachedRequest], positions: np.ndarray,
                                prompt_lens: np.ndarray, table_rows: np.ndarray
                                ) -> Optional[int]:
        """`_last_tokens` for a step of decodes (row i: records[i] at positions[i]) whose every
        input is the previous plain step's sample, in array operations: input ids 0, each row
        queued to take its id from the device. Returns the count of rows, or None (nothing
        written) where that does not hold or the step is small (`_ARRAY_MIN_ROWS`)."""
        prev = self._prev_sampled
        n = len(records)
        if prev is None or not prev.requests or n < _ARRAY_MIN_ROWS:
            return None
        known = prompt_lens + np.fromiter(map(len, map(_output_token_ids, records)), np.int64, n)
        if (positions < known).any():
            return None
        src, sample_positions = prev.by_table_row(table_rows, self.requests.tables.array.shape[0])
        if (sample_positions != positions).any():
            return None
        b = self.buffers
        b.input_ids.np[:n] = 0
        b.prev_token_dst.np[:n] = np.arange(n)
        b.prev_token_src.np[:n] = src
        return n

    def _last_tokens(self, records: list[CachedRequest], positions: list[int],
                     offsets) -> tuple[list[int], int]:
        """Decodes' input tokens, records[i]'s at positions[i] for input row offsets[i]: its id
        where the host knows it; else 0, with the row queued to take the id from the previous
        step's samples on the device (`fill_prev_token_ids`). Returns the ids and the count of
        queued rows."""
        ids = []
        dst, src = [], []
        prev = self._prev_sampled
        in_flight = prev.by_request_id().get if prev is not None else {}.get
        for r, position, offset in zip(records, positions, offsets):
            if position < len(r.prompt_token_ids) + len(r.output_token_ids):
                ids.append(r.token_at(position))
                continue
            # Sampled by the step in flight (its one token in flight, or the last of a
            # verification in flight): the host does not know it yet.
            entry = in_flight(r.request_id)
            if entry is None or entry[1] != position:
                raise RuntimeError(f"request {r.request_id!r}: input token {position} is neither "
                                   f"known ({r.num_tokens} are) nor sampled by the previous step")
            ids.append(0)
            dst.append(offset)
            src.append(entry[0])
        if dst:
            b = self.buffers
            b.prev_token_dst.np[:len(dst)] = dst
            b.prev_token_src.np[:len(src)] = src
        return ids, len(dst)
