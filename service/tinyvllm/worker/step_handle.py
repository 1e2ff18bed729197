"""StepHandle: a launched model step whose sampled tokens may still be on their way to the host.

`ModelRunner.execute_async` launches a step and returns a handle without a host sync; the engine
schedules and launches the next step, then calls `result()`, which waits for this step's copy of
the sampled ids into pinned host memory (an event, not a stream sync: later steps keep running),
and appends them to the worker's records of the requests.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Callable, Optional

import torch

from tinyvllm.scheduling.output import DraftTokens, PromptLogprobs, SampledTokens
from tinyvllm.worker.prompt_logprobs import StepPromptLogprobs
from tinyvllm.worker.requests import CachedRequest, append_sampled
from tinyvllm.worker.sampler import SampledTensors, SamplingState


_request_id = attrgetter("request_id")


class StepHandle:
    """A launched step. `result()` waits for its sampled ids (the step's one host sync) and
    returns them, and sets `prompt_logprobs` (those the step computed, by request id); on the CPU,
    or when nothing was sampled or scored, it is done from the start."""

    def __init__(self, requests: list[CachedRequest], states: list[SamplingState],
                 sampled: Optional[SampledTensors], ready: Optional[torch.cuda.Event],
                 prompt: Optional[StepPromptLogprobs] = None,
                 lengths: Optional[list[int]] = None):
        assert sampled is None or lengths is not None, "sampled tokens need their lengths"
        self._requests = requests
        self._lengths = lengths  # each record's length before its token (`append_sampled`)
        self._states = states
        self._sampled = sampled  # on pinned host memory once `ready` has completed
        self._prompt = prompt  # likewise
        self._ready = ready
        self._result: Optional[SampledTokens] = (
            None if sampled is not None or prompt is not None else {})
        self.prompt_logprobs: PromptLogprobs = {}
        # Draft-model speculation: set by the runner, which drafts once the step's tokens are in.
        self.draft_token_ids: DraftTokens = {}
        self._finish: Optional[Callable[[], SampledTokens]] = None

    @classmethod
    def done(cls) -> "StepHandle":
        """A step that sampled nothing."""
        return cls([], [], None, None)

    @classmethod
    def finished(cls, result: SampledTokens,
                 prompt: Optional[StepPromptLogprobs] = None) -> "StepHandle":
        """A step whose tokens are already on the host."""
        handle = cls([], [], None, None)
        handle._result = result
        if prompt is not None:
            handle.prompt_logprobs = prompt.to_lists()
        return handle

    @classmethod
    def deferred(cls, finish: Callable[[], SampledTokens],
                 prompt: Optional[StepPromptLogprobs] = None,
                 on_cuda: bool = False) -> "StepHandle":
        """A step whose tokens `finish` brings to the host (waiting for its own copies) and
        appends to the records: a verification (`PendingVerification.result`)."""
        handle = cls.launch([], [], None, prompt=prompt, on_cuda=on_cuda)
        handle._result, handle._finish = None, finish
        return handle

    @classmethod
    def launch(cls, requests: list[CachedRequest], states: list[SamplingState],
               sampled: Optional[SampledTensors], ids_buffer: Optional[torch.Tensor] = None,
               prompt: Optional[StepPromptLogprobs] = None,
               on_cuda: bool = False, lengths: Optional[list[int]] = None) -> "StepHandle":
        """Start the device-to-host copies of `sampled` and `prompt` (CUDA) and record when they
        are done. ids_buffer: pinned host memory for the token ids
        (SampledTensors.to_pinned_host). lengths: per request, the length its record must have
        for its token to be appended (a step scheduled behind a verification that fell short
        is dropped, `Scheduler.update`)."""
        if not on_cuda:
            return cls(requests, states, sampled, None, prompt, lengths)
        host = sampled.to_pinned_host(ids_buffer) if sampled is not None else None
        prompt = prompt.to_pinned_host() if prompt is not None else None
        ready = torch.cuda.Event()
        ready.record()
        return cls(requests, states, host, ready, prompt, lengths)

    def result(self) -> SampledTokens:
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._result = self._finish() if self._finish is not None else {}
            if self._sampled is not None:
                out = self._sampled.to_output(self._states)
                self._result = dict(zip(map(_request_id, self._requests),
                                        zip(out.token_ids, out.logprobs)))
                append_sampled(self._requests, out.token_ids, self._lengths)
            if self._prompt is not None:
                self.prompt_logprobs = self._prompt.to_lists()
            self._sampled = self._prompt = None
        return self._result
