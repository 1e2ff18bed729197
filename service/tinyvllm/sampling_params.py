"""Sampling parameters, shaped like vLLM's `SamplingParams`.

Every invalid value raises `InvalidRequestError` naming the field, which the servers turn into
INVALID_ARGUMENT (gRPC) or 400 (HTTP) naming it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from tinyvllm.errors import InvalidRequestError

MAX_LOGPROBS = 20
"""Most top-n logprobs a request may ask for."""

MAX_TEMPERATURE = 100.0
"""Highest temperature accepted. At 100 the distribution is already uniform to within float32
rounding of typical logits; larger values (1e38) only hide a client bug."""

MAX_REPETITION_PENALTY = 100.0
"""Highest repetition penalty accepted (2 is already strong); larger values overflow logits."""

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


@dataclass
class SamplingParams:
    """How to sample the continuation of one prompt.

    Attributes:
        n: completions per prompt (offline API fans out into n requests with derived seeds).
        temperature: 0 means greedy.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below min_p * max probability; 0 disables.
        seed: per-request seed; the same seed gives the same sample whatever the batch.
        repetition_penalty: > 1 discourages tokens already in prompt or output (CTRL-style).
        presence_penalty, frequency_penalty: OpenAI-style, over output tokens, in [-2, 2].
        max_tokens: most tokens to generate; None (the default, as vLLM's chat and completion
            APIs) means up to the model's context length: context minus prompt tokens.
        min_tokens: EOS and stop token ids are suppressed until this many tokens exist.
        stop: strings that end the output (not included unless include_stop_str_in_output).
        stop_token_ids: token ids that end the output (included in token_ids, not in text).
        ignore_eos: keep generating after EOS.
        logprobs: number of top logprobs to return per generated token (None: none).
        prompt_logprobs: number of top logprobs to return per prompt token (None: none); each
            prompt token after the first also gets its own logprob and rank under the model given
            the tokens before it (the first gets None). Such a prompt is computed whole, never
            served from the prefix cache.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep a matched stop string in the text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, message: str) -> None:
            raise InvalidRequestError(name, message)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        for name in _FLOAT_FIELDS:  # NaN and inf pass some range checks below, never this one
            if not math.isfinite(getattr(self, name)):
                bad(name, f"must be a finite number, got {getattr(self, name)}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "every stop token id must be a non-negative integer")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


_GREEDY_EPS = 1e-5
