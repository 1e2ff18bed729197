"""What a caller of the engine gets back, shaped like vLLM's `RequestOutput`.

Cumulative fields (text, token_ids, logprobs) suit the offline API; the delta fields carry what
one engine step added, for streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from tinyvllm.scheduling.request import FinishReason


@dataclass
class Logprob:
    """One candidate token's logprob at one position."""

    logprob: float
    rank: int  # 1 = most likely
    decoded_token: Optional[str] = None


PositionLogprobs = dict[int, Logprob]
"""Token id -> Logprob at one position: the sampled (or prompt) token first, then the top-n."""


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: which of the prompt's n completions this is.
        text: the text so far (without a matched stop string unless asked for).
        token_ids: the generated token ids so far.
        cumulative_logprob: sum of the sampled tokens' logprobs (None unless logprobs asked).
        logprobs: per generated token (None unless logprobs asked).
        finish_reason: why it ended (STOP, LENGTH, ABORT or ERROR); None while running.
        stop_reason: the stop string or stop token id that ended it; None for EOS or length.
        delta_text, delta_token_ids, delta_logprobs: what the latest step added.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: Optional[list[PositionLogprobs]] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counts of one request.

    `first_scheduled_time` is when the engine step that produced the first token started (set by
    the server's engine client; None offline)."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    """One request's state after an engine step.

    Attributes:
        prompt_logprobs: per prompt token, its logprob and the top-n (vLLM's shape: None for
            the first token, which nothing precedes); None unless prompt_logprobs asked. Complete
            from the first output on (the prompt is scored before the first token is sampled).
        error: the engine's message when finish_reason is ERROR (for the INTERNAL status).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    error: Optional[str] = None
