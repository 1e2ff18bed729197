"""EngineCore: the synchronous heart of tinyvllm.

The same class runs in-process for `LLM.generate` and tests, and inside the engine process behind
the gRPC server. One model step is: schedule, run the model, update the requests.

With async scheduling (the default) one model step stays in flight between `step()` calls:

```
host:  launch N+1 ─▶ wait for N's samples ─▶ update(N), return ─▶ launch N+2 ─▶ wait for N+1 ...
GPU:   ...... N ..............│........ N+1 ...............................│...... N+2 ......
```

so the host work between two launches (update, the caller's output processing, the next
schedule and input preparation) runs while the GPU computes. A step is scheduled ahead only when
its sampling needs no host knowledge of the tokens in flight (`Scheduler.can_schedule_ahead`);
otherwise `step()` runs the model step synchronously, as it does with async scheduling off.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Iterable, Optional, Protocol

from tinyvllm.config import EngineConfig, RuntimeInfo
from tinyvllm.engine.executor import make_executor
from tinyvllm.engine.stats import EngineStats
from tinyvllm.engine.validation import validate_request
from tinyvllm.errors import InvalidRequestError
from tinyvllm.scheduling.kv_cache_manager import KVCacheManager
from tinyvllm.scheduling.output import (DraftTokens, PromptLogprobs, SampledTokens,
                                        SchedulerOutput)
from tinyvllm.scheduling.request import EngineCoreOutput, EngineCoreRequest, Request
from tinyvllm.scheduling.scheduler import Scheduler


class StepHandle(Protocol):
    """A launched step (`ModelRunner.execute_async`, or a step published to worker processes)."""

    prompt_logprobs: PromptLogprobs  # those the step computed, set by `result()`
    draft_token_ids: DraftTokens  # the draft model's proposals, set by `result()` (or before)

    def result(self) -> SampledTokens: ...

logger = logging.getLogger(__name__)
_new_token_ids = attrgetter("new_token_ids")


@dataclass
class _LaunchedStep:
    out: SchedulerOutput
    handle: StepHandle


class EngineCore:
    """The step loop over a scheduler and an executor (by default the one the config names:
    `ParallelConfig.executor_backend`; tests and benchmarks pass their own)."""

    def __init__(self, config: EngineConfig, executor: Any = None):
        self.config = config
        self.executor = executor if executor is not None else make_executor(config)
        info = self.executor.info
        self.tokenizer = self.executor.tokenizer
        self.max_model_len = self._fit_max_model_len(info.num_blocks, info.block_size,
                                                     info.max_model_len)
        self.runtime_info = RuntimeInfo(
            num_kv_blocks=info.num_blocks, block_size=info.block_size,
            max_model_len=self.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids), model_name=info.model_name,
            device=info.device, dtype=info.dtype)
        seed = config.cache.prefix_cache_seed
        kv = KVCacheManager(info.num_blocks, info.block_size, config.cache.enable_prefix_caching,
                            seed if seed is not None else secrets.randbits(63))
        # The step sizes the runner was built for: the config's, or chosen for its device.
        sched = dataclasses.replace(config.scheduler, max_num_seqs=info.max_num_seqs,
                                    max_num_batched_tokens=info.max_num_batched_tokens)
        self.config = dataclasses.replace(config, scheduler=sched)
        self.scheduler = Scheduler(sched, kv, self.max_model_len, config.speculative)
        self._eos = frozenset(info.eos_token_ids)
        self._num_generation_tokens = 0
        self._num_scheduled_tokens = 0
        wanted = config.scheduler.async_scheduling
        self.async_scheduling = self.executor.device_type == "cuda" if wanted is None else wanted
        self.scheduler.spec.schedule_ahead(self.async_scheduling,
                                           config.parallel.tensor_parallel_size)
        self._in_flight: Optional[_LaunchedStep] = None

    @staticmethod
    def _fit_max_model_len(num_blocks: int, block_size: int, max_model_len: int) -> int:
        """The context length, capped so that one request alone always fits in the KV cache
        (otherwise preemption could never make room for it)."""
        capacity = (num_blocks - 1) * block_size
        if capacity < max_model_len:
            logger.warning("max_model_len %d capped to %d tokens: the KV cache holds no more",
                           max_model_len, capacity)
        return min(max_model_len, capacity)

    @property
    def runner(self):
        """The in-process model runner (UniProcExecutor only)."""
        return self.executor.runner

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. Raises InvalidRequestError naming the bad field."""
        validate_request(req, self.runtime_info)
        if req.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already in use")
        request = Request.from_engine_core_request(req, self._eos, self.max_model_len)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests now and free their KV blocks (unknown or finished ids are ignored).

        A step in flight still computes for them; its tokens for them are dropped."""
        self.scheduler.abort_requests(list(request_ids))

    @property
    def has_step_in_flight(self) -> bool:
        """Whether a model step was launched ahead and has not been returned by `step()`."""
        return self._in_flight is not None

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or a model step is in flight."""
        return self.has_step_in_flight or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Run one model step and return what it produced (see the module docstring).

        With a step in flight from the previous call, the next one is launched before that
        step's tokens are processed; either way, the outputs returned are of one model step."""
        start_s = time.perf_counter()
        current = self._in_flight or self._launch()
        self._in_flight = None
        if current is None:
            return []
        if self.async_scheduling and self.scheduler.can_schedule_ahead():
            self._in_flight = self._launch()
        sampled = current.handle.result()
        outputs = self.scheduler.update(current.out, sampled, current.handle.prompt_logprobs,
                                        current.handle.draft_token_ids)
        self._count(current.out, outputs)
        if self.scheduler.spec.config.enabled:
            # With a step scheduled ahead, a call's time is one step of the pipeline.
            self._observe_spec_cost(current.out, outputs, time.perf_counter() - start_s)
        return outputs

    def _observe_spec_cost(self, out: SchedulerOutput, outputs: list[EngineCoreOutput],
                           duration_s: float) -> None:
        """Tell the speculation policy what a decode-only step cost (a step with a prefill
        chunk is not comparable: it is counted, not timed)."""
        if any(s.num_new_tokens != 1 + len(s.draft_token_ids) or not s.completes_sequence
               for s in out.scheduled):
            duration_s = 0.0
        speculated = any(s.draft_token_ids for s in out.scheduled)
        self.scheduler.spec.observe_step(duration_s, sum(len(o.new_token_ids) for o in outputs),
                                         speculated)

    def _launch(self) -> Optional[_LaunchedStep]:
        """Schedule a step and launch it on the model runner (None: nothing to run)."""
        if not self.scheduler.has_unfinished_requests():
            return None
        out = self.scheduler.schedule()
        handle = self.executor.execute_async(out)  # also hands over finished ids when empty
        return None if out.is_empty else _LaunchedStep(out, handle)

    def _count(self, out: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        self._num_scheduled_tokens = out.num_scheduled_tokens
        self._num_generation_tokens += sum(map(len, map(_new_token_ids, outputs)))

    def get_stats(self) -> EngineStats:
        kv = self.kv
        spec = self.scheduler.spec.stats
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=kv.num_blocks - 1, num_free_kv_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.scheduler.num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_scheduled_tokens=self._num_scheduled_tokens,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_num_accepted_per_position=list(spec.accepted_per_position))

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        """Abort every request and wait for the step in flight (its kernels use the KV cache)."""
        self.scheduler.abort_requests(list(self.scheduler.requests))
        if self._in_flight is not None:
            self._in_flight.handle.result()
            self._in_flight = None
        self.executor.shutdown()

