"""Turn each engine step's `EngineCoreOutput`s into `RequestOutput`s.

Runs in the frontend, off the engine's critical path: detokenization, stop strings, logprob
decoding and metrics happen here. Stop strings are found here, not in the engine, so a request
stopped by one is still running there: it is reported in `reqs_to_abort` so that the caller aborts
it in the engine and its KV blocks are freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from tokenizers import Tokenizer

from tinyvllm.errors import InvalidRequestError
from tinyvllm.scheduling.request import EngineCoreOutput, FinishReason, Logprobs
from tinyvllm.frontend.detokenizer import IncrementalDetokenizer
from tinyvllm.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from tinyvllm.sampling_params import SamplingParams


@dataclass
class ProcessedOutputs:
    """Result of one `process_outputs` call.

    Attributes:
        request_outputs: one per request that had news this step.
        reqs_to_abort: requests finished by a stop string; the engine still runs them.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _RequestState:
    """Frontend-side state of one unfinished request."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: Optional[list[PositionLogprobs]] = None
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    cumulative_logprob: Optional[float] = None
    num_cached_tokens: int = 0


class OutputProcessor:
    """Keeps one `_RequestState` per unfinished request; forgets a request once it finishes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        # Token id -> text, for logprob entries; bounded by the vocabulary size.
        self._token_text: dict[int, str] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> None:
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        wants_logprobs = params.logprobs is not None
        self._requests[request_id] = _RequestState(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids),
            metrics=RequestMetrics(arrival_time=arrival_time),
            logprobs=[] if wants_logprobs else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            cumulative_logprob=0.0 if wants_logprobs else None)

    def abort_request(self, request_id: str) -> None:
        """Forget a request (client cancel); unknown or finished ids are ignored."""
        self._requests.pop(request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one engine step's outputs. Outputs of unknown (aborted) requests are dropped."""
        now = time.monotonic()
        result = ProcessedOutputs()
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue
            if output.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(
                    None if lp is None else self._position_logprobs(lp)
                    for lp in output.new_prompt_logprobs)
                if not output.new_token_ids and output.finish_reason is None:
                    continue  # a prefill chunk's prompt logprobs: nothing to report yet
            request_output, stopped_by_string = self._process_one(state, output, now)
            result.request_outputs.append(request_output)
            if request_output.finished:
                del self._requests[output.request_id]
                if stopped_by_string and output.finish_reason is None:
                    result.reqs_to_abort.append(output.request_id)
        return result

    def _process_one(self, state: _RequestState, output: EngineCoreOutput,
                     now: float) -> tuple[RequestOutput, bool]:
        """Returns the request's output and whether a stop string ended it."""
        detok = state.detokenizer
        num_before = len(detok.token_ids)
        stop_string = detok.update(output.new_token_ids,
                                   stop_terminated=output.finish_reason == FinishReason.STOP)
        new_token_ids = detok.token_ids[num_before:]  # shorter when a stop string cut them
        delta_logprobs = self._append_logprobs(state, output.new_logprobs, len(new_token_ids))

        finish_reason: Optional[FinishReason] = output.finish_reason
        stop_reason: int | str | None = output.stop_reason
        if stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_string
        finished = finish_reason is not None

        self._update_metrics(state, len(new_token_ids), finished, now)
        state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
        delta_text = detok.get_next_delta(finished)  # on finish, releases the held-back tail
        completion = CompletionOutput(
            index=0, text=detok.released_text, token_ids=list(detok.token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=finish_reason, stop_reason=stop_reason,
            delta_text=delta_text, delta_token_ids=new_token_ids, delta_logprobs=delta_logprobs)
        request_output = RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=[completion], finished=finished,
            num_cached_tokens=state.num_cached_tokens, metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs, error=output.error)
        return request_output, stop_string is not None

    def _append_logprobs(self, state: _RequestState, new_logprobs: Optional[list[Logprobs]],
                         num_new_tokens: int) -> Optional[list[PositionLogprobs]]:
        """Decode the kept tokens' logprobs, append them to the request's; return the delta."""
        if state.logprobs is None:
            return None
        kept = (new_logprobs or [])[:num_new_tokens]
        delta = [self._position_logprobs(lp) for lp in kept]
        state.logprobs.extend(delta)
        state.cumulative_logprob += sum(lp.logprob for lp in kept)
        return delta

    def _position_logprobs(self, lp: Logprobs) -> PositionLogprobs:
        """The sampled token first, then the top-n (a sampled token in the top-n appears once)."""
        self._decode_tokens([lp.token_id, *lp.top_token_ids])
        entries = {lp.token_id: Logprob(lp.logprob, lp.rank, self._token_text[lp.token_id])}
        for rank, (token_id, logprob) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), 1):
            entries.setdefault(token_id, Logprob(logprob, rank, self._token_text[token_id]))
        return entries

    def _decode_tokens(self, token_ids: list[int]) -> None:
        """Fill the token text cache for these ids (one batched decode for the missing ones)."""
        missing = [t for t in dict.fromkeys(token_ids) if t not in self._token_text]
        if missing:
            texts = self.tokenizer.decode_batch([[t] for t in missing], skip_special_tokens=False)
            self._token_text.update(zip(missing, texts))

    @staticmethod
    def _update_metrics(state: _RequestState, num_new_tokens: int, finished: bool,
                        now: float) -> None:
        metrics = state.metrics
        if num_new_tokens:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generation_tokens += num_new_tokens
        if finished:
            metrics.finished_time = now

