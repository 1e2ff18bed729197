"""Our side of every benchmark: requests driven straight through `EngineCore.step()`.

Timing the engine loop directly (no detokenizer, no output processor) makes TTFT and the time of
each decode step exact, and matches what the transformers baseline does: token ids in, token ids
out. Every request is greedy with `ignore_eos`, so the token counts are fixed in advance.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import UniProcExecutor
from tinyvllm.scheduling.request import EngineCoreRequest
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_request_ids = itertools.count()
LEFTOVER_WARNING_BYTES = 1 << 30


@dataclass
class RequestTiming:
    """One request: perf_counter seconds of each output token, relative to submission."""

    num_prompt_tokens: int
    token_times_s: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0]

    @property
    def inter_token_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class BatchRun:
    """Requests submitted together and run to completion."""

    elapsed_s: float
    requests: list[RequestTiming]
    num_steps: int

    @property
    def num_output_tokens(self) -> int:
        return sum(len(r.token_times_s) for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)

    @property
    def num_cached_tokens(self) -> int:
        return sum(r.num_cached_tokens for r in self.requests)

    def rates(self) -> dict[str, float]:
        return {"output_tokens_per_s": self.num_output_tokens / self.elapsed_s,
                "requests_per_s": len(self.requests) / self.elapsed_s,
                "elapsed_s": self.elapsed_s, "num_output_tokens": self.num_output_tokens,
                "num_steps": self.num_steps}


def build_engine(config: EngineConfig, runner=None) -> EngineCore:
    """An engine (loading the model unless `runner`, an already loaded ModelRunner, is given),
    over the executor the config names (`--distributed-executor-backend`)."""
    if runner is None and config.parallel.executor_backend != "uni":
        return EngineCore(config)
    return EngineCore(config, UniProcExecutor(config, runner))


def local_runner(engine: EngineCore):
    """The engine's model runner when it runs in this process, else None (worker processes)."""
    return getattr(engine.executor, "runner", None)


def greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_batch(engine: EngineCore, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
              sync: Callable[[], None]) -> BatchRun:
    """Submit every prompt at once, step until all finish; time each token as the host sees it.

    A step returns once its sampled ids are on the host: that is when its tokens count. With
    async scheduling the next step is already running on the device then, so `sync` is taken only
    before the clock starts and before it stops (one between steps would serialise them).
    """
    with frozen_heap():
        return _run_batch(engine, prompts, output_lens, sync)


@contextlib.contextmanager
def frozen_heap():
    """Freeze the heap from before a timed run while it runs, as `tinyvllm serve`'s engine
    process freezes its start-up heap (engine/core_proc.py), so the cyclic collector walks only
    what the run makes; thawed after, so a dropped engine's memory can still be collected."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run_batch(engine: EngineCore, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
               sync: Callable[[], None]) -> BatchRun:
    ids = [str(next(_request_ids)) for _ in prompts]
    timings = {i: RequestTiming(len(p)) for i, p in zip(ids, prompts)}
    sync()
    start = time.perf_counter()
    for request_id, prompt, n in zip(ids, prompts, output_lens):
        engine.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=list(prompt),
                                             sampling_params=greedy(n), arrival_time=start))
    num_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        num_steps += 1
        for out in outputs:
            t = timings[out.request_id]
            if not t.token_times_s:
                t.num_cached_tokens = out.num_cached_tokens
            t.token_times_s.extend([now] * len(out.new_token_ids))
    sync()
    elapsed = time.perf_counter() - start
    return BatchRun(elapsed, [timings[i] for i in ids], num_steps)


def free_memory() -> None:
    """Give dropped models' device memory back, so the next one can load. The caller drops its
    own references first (`engine = None`)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated()
        if left > LEFTOVER_WARNING_BYTES:  # something still holds the engine: the baseline may OOM
            logger.warning("%.1f GiB of GPU memory still allocated after release", left / 2**30)


def weight_bytes(engine: EngineCore) -> int:
    """Bytes of every weight one decode step reads (parameters and quantized-weight buffers)."""
    model = engine.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                 if "cos_sin" not in name)  # the rotary table: one row per token, not per step
    return total


def kv_bytes_per_token(engine: EngineCore) -> int:
    """K and V bytes of one token across all layers, in the engine's KV-cache dtype."""
    runner = engine.runner
    elem = runner.kv_caches[0].element_size()
    a = runner.arch
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * elem


def is_packed(engine: EngineCore) -> bool:
    """Whether the engine's model serves packed GGUF weights (the CPU or the GPU kernels)."""
    from tinyvllm.model.packed import PackedLinear

    runner = local_runner(engine)
    return runner is not None and any(isinstance(m, PackedLinear) for m in runner.model.modules())
