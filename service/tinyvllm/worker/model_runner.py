"""ModelRunner: turns a SchedulerOutput into flat tensors, runs the model, samples.

It makes no policy decisions: which tokens to compute was decided by the scheduler. It owns the
model, the paged KV cache (one tensor per layer, layout `ops.KV_CACHE_LAYOUT`), and per-request
sampling state (seeded generators) for as long as a request runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tinyvllm.config import CacheConfig, EngineConfig
from tinyvllm.engine.request import Logprobs, Request
from tinyvllm.engine.scheduler import SchedulerOutput
from tinyvllm.model.loader import LoadedModel, load_model
from tinyvllm.ops import AttentionMetadata, allocate_kv_caches
from tinyvllm.worker.sampler import Sampler, SamplingState

logger = logging.getLogger(__name__)

_GIB = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: last token of each completed sequence
    sampled_requests: list[Request]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None):
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if config.cache.kv_cache_dtype == "fp8" and self.device.type != "cuda":
            raise ValueError("kv_cache_dtype: fp8 needs a CUDA device")
        self.loaded = loaded or load_model(config.model.model, self.dtype, self.device)
        self.model = self.loaded.model
        self.arch = self.loaded.arch
        self.max_model_len = min(config.model.max_model_len or self.loaded.max_model_len,
                                 self.loaded.max_model_len)
        self.block_size = config.cache.block_size
        self.num_blocks = self._determine_num_blocks(config.cache)
        self.kv_caches = allocate_kv_caches(
            self.arch.num_layers, self.num_blocks, self.block_size, self.arch.num_kv_heads,
            self.arch.head_dim, self.dtype, self.device)
        self.sampler = Sampler()
        self.sampling_states: dict[str, SamplingState] = {}
        logger.info("KV cache: %d blocks of %d tokens on %s", self.num_blocks, self.block_size,
                    self.device)

    # --- sizing ---------------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * elem

    def _determine_num_blocks(self, cache: CacheConfig) -> int:
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.device.type != "cuda":
            return max(2, int(cache.kv_cache_memory_gb * _GIB) // self.kv_bytes_per_block())
        return self._profile_num_blocks(cache)

    def _profile_num_blocks(self, cache: CacheConfig) -> int:
        """Run the largest batch once, then give the KV cache what the budget leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.scheduler.max_num_batched_tokens
        self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        available = total * cache.gpu_memory_utilization - peak
        num_blocks = int(available) // self.kv_bytes_per_block()
        if num_blocks < 2:
            raise RuntimeError(
                f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves no room for the KV "
                f"cache (peak use {peak / _GIB:.1f} GiB of {total / _GIB:.1f} GiB)")
        return num_blocks

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> None:
        """A single sequence of num_tokens tokens over a throwaway one-block-per-16 cache."""
        caches = allocate_kv_caches(self.arch.num_layers, -(-num_tokens // self.block_size) + 1,
                                    self.block_size, self.arch.num_kv_heads, self.arch.head_dim,
                                    self.dtype, self.device)
        num_blocks = -(-num_tokens // self.block_size)
        meta = self._metadata(
            slot_mapping=np.arange(self.block_size, self.block_size + num_tokens),
            query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
            block_tables=np.arange(1, num_blocks + 1, dtype=np.int32)[None])
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), caches, meta)
        self.model.compute_logits(hidden[-1:])
        del caches

    # --- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, Optional[Logprobs]]]:
        for request_id in out.finished_request_ids:
            self.sampling_states.pop(request_id, None)
        if out.is_empty:
            return {}
        inputs = self._prepare_inputs(out)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampled_requests:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        states = [self._sampling_state(r) for r in inputs.sampled_requests]
        result = self.sampler(logits, states)
        return {r.request_id: (tok, lp) for r, tok, lp in
                zip(inputs.sampled_requests, result.token_ids, result.logprobs)}

    def _prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        bs = self.block_size
        ids, positions, slots, qsl, seq_lens, logits_idx, sampled = [], [], [], [0], [], [], []
        max_blocks = max(len(s.request.block_ids) for s in out.scheduled)
        block_tables = np.zeros((len(out.scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(out.scheduled):
            r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            ids.append(_token_slice(r, start, start + n))
            pos = np.arange(start, start + n)
            table = np.asarray(r.block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            block_tables[i, :len(table)] = table
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            if s.completes_sequence:
                logits_idx.append(qsl[-1] - 1)
                sampled.append(r)
        meta = self._metadata(np.concatenate(slots), qsl, seq_lens, block_tables)
        return ModelInputs(
            input_ids=self._to_device(np.concatenate(ids), torch.long),
            positions=self._to_device(np.concatenate(positions), torch.long),
            meta=meta,
            logits_indices=self._to_device(np.asarray(logits_idx), torch.long),
            sampled_requests=sampled)

    def _metadata(self, slot_mapping, query_start_loc, seq_lens, block_tables) -> AttentionMetadata:
        q_lens = np.diff(query_start_loc)
        return AttentionMetadata(
            num_tokens=int(query_start_loc[-1]),
            slot_mapping=self._to_device(slot_mapping, torch.long),
            query_start_loc=self._to_device(np.asarray(query_start_loc), torch.int32),
            seq_lens=self._to_device(np.asarray(seq_lens), torch.int32),
            block_tables=self._to_device(block_tables, torch.int32),
            max_query_len=int(q_lens.max()), max_seq_len=int(max(seq_lens)),
            query_start_loc_cpu=list(map(int, query_start_loc)),
            seq_lens_cpu=list(map(int, seq_lens)))

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _sampling_state(self, request: Request) -> SamplingState:
        state = self.sampling_states.get(request.request_id)
        if state is None:
            params = request.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = SamplingState(params=params, prompt_token_ids=request.prompt_token_ids,
                                  output_token_ids=request.output_token_ids,
                                  eos_token_ids=request.eos_token_ids, generator=generator)
            self.sampling_states[request.request_id] = state
        return state


def _token_slice(request: Request, start: int, end: int) -> np.ndarray:
    """Token ids [start, end) of prompt + output without concatenating the whole sequence."""
    p = request.num_prompt_tokens
    if start >= p:
        return np.asarray(request.output_token_ids[start - p:end - p], dtype=np.int64)
    if end <= p:
        return np.asarray(request.prompt_token_ids[start:end], dtype=np.int64)
    return np.asarray(request.prompt_token_ids[start:] + request.output_token_ids[:end - p],
                      dtype=np.int64)
