"""StepHandle: a launched model step whose sampled tokens may still be on their way to the host.

`ModelRunner.execute_async` launches a step and returns a handle without a host sync; the engine
schedules and launches the next step, then calls `result()`, which waits for this step's copy of
the sampled ids into pinned host memory (an event, not a stream sync: later steps keep running),
and appends them to the worker's records of the requests.
"""

from __future__ import annotations

from typing import Optional

import torch

from tinyvllm.scheduling.output import SampledTokens
from tinyvllm.worker.requests import CachedRequest
from tinyvllm.worker.sampler import SampledTensors, SamplingState


class StepHandle:
    """A launched step. `result()` waits for its sampled ids (the step's one host sync) and
    returns them; on the CPU, or when nothing was sampled, it is done from the start."""

    def __init__(self, requests: list[CachedRequest], states: list[SamplingState],
                 sampled: Optional[SampledTensors], ready: Optional[torch.cuda.Event]):
        self._requests = requests
        self._states = states
        self._sampled = sampled  # on pinned host memory once `ready` has completed
        self._ready = ready
        self._result: Optional[SampledTokens] = None if sampled is not None else {}

    @classmethod
    def done(cls) -> "StepHandle":
        """A step that sampled nothing."""
        return cls([], [], None, None)

    @classmethod
    def finished(cls, result: SampledTokens) -> "StepHandle":
        """A step whose tokens are already on the host."""
        handle = cls([], [], None, None)
        handle._result = result
        return handle

    @classmethod
    def launch(cls, requests: list[CachedRequest], states: list[SamplingState],
               sampled: SampledTensors,
               ids_buffer: Optional[torch.Tensor] = None) -> "StepHandle":
        """Start the device-to-host copies of `sampled` (CUDA) and record when they are done.
        ids_buffer: pinned host memory for the token ids (SampledTensors.to_pinned_host)."""
        if sampled.token_ids.device.type != "cuda":
            return cls(requests, states, sampled, None)
        host = sampled.to_pinned_host(ids_buffer)
        ready = torch.cuda.Event()
        ready.record()
        return cls(requests, states, host, ready)

    def result(self) -> SampledTokens:
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            out = self._sampled.to_output(self._states)
            self._result = {r.request_id: (tok, lp) for r, tok, lp in
                            zip(self._requests, out.token_ids, out.logprobs)}
            for r, tok in zip(self._requests, out.token_ids):
                r.output_token_ids.append(tok)
            self._sampled = None
        return self._result
