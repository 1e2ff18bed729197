"""Requests as the engine core sees them, and what it reports back once per step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import msgspec

from tinyvllm.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request ended. A str enum: msgspec sends its value across IPC, and it prints, logs
    and serializes to JSON as that value ("stop")."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client, a deadline or shutdown
    ERROR = "error"  # the engine failed on this request


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the frontend sends to the engine core (crosses the process boundary)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: Optional[str] = None


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs of one sampled (or prompt) token: its own and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top_token_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's news from one engine step (one batch of these crosses IPC per step).
    Made for every request every step, and never part of a reference cycle: untracked by the
    cyclic collector (gc=False), as `ScheduledRequest`."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[Logprobs]] = None
    # Prompt logprobs computed this step, in prompt order (None for the first prompt token). A
    # prefill chunk that samples nothing still reports them, with no new_token_ids.
    new_prompt_logprobs: Optional[list[Optional[Logprobs]]] = None
    finish_reason: Optional[FinishReason] = None  # set once finished
    stop_reason: Optional[int] = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: Optional[str] = None


@dataclass(eq=False)
class Request:
    """Engine-side state of one request.

    The scheduler speaks tokens: `num_computed_tokens` chases `num_tokens` +
    `num_output_placeholders`, and moves when a step is scheduled (its KV is then written or
    queued to be). A request is prefilling while `num_computed_tokens < num_prompt_tokens`;
    preemption resets `num_computed_tokens` to 0 and keeps `output_token_ids`, which are
    recomputed as part of the prompt (so a preempted request finishes with the same greedy output).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: Optional[str] = None
    eos_token_ids: frozenset = frozenset()
    max_model_len: int = 1 << 30

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens scheduled to be sampled whose ids the host does not know yet (async scheduling: at
    # most the step in flight plus the one just scheduled). They count toward the sequence length
    # when scheduling, so that a decode of a token still in flight is scheduled at its position.
    num_output_placeholders: int = 0
    # Its latest scheduled step not yet updated (-1: none), and that step's drafts: a step
    # scheduled behind a verification assumes every draft accepted (Scheduler.update).
    last_step_id: int = -1
    in_flight_drafts: Sequence[int] = ()
    # A step scheduled behind a verification that accepted fewer: its result is dropped.
    discard_step_id: int = -1
    # Set on first scheduling (when the workers learn of it); -1 = not scheduled yet.
    num_cached_tokens: int = -1
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[int] = None
    num_preemptions: int = 0
    spec_k: int = 0  # draft tokens it may propose next (speculative decoding; adapts)
    spec_misses: int = 0  # one-token drafts rejected in a row
    spec_streak: int = 0  # verifications in a row that accepted every draft
    spec_skip: int = 0  # steps left in which it drafts nothing (after misses or no match)
    spec_no_match: int = 0  # prompt lookups in a row that matched nothing (while paused too)
    # The n-gram proposer's numpy copy of prompt + output (scheduling/spec_decode.py), extended as
    # tokens are appended.
    spec_token_buffer: Optional[Any] = None
    spec_token_buffer_len: int = 0
    # The draft model's proposal after its last token (the worker's, from the step that sampled
    # it); taken by its next schedule.
    draft_token_ids: list[int] = field(default_factory=list)
    # Most output tokens: the user's max_tokens, capped by the model's context length (set from
    # the prompt, which never changes; read per request per step).
    max_tokens: int = field(init=False)
    # Whether its sampling can ever read its output ids on the host (penalties, min_tokens):
    # `sampling_reads_output_tokens` is asked only of such requests.
    may_read_output_tokens: bool = field(init=False)
    # The token ids that can end it once it has min_tokens: the stop token ids, and EOS unless
    # ignore_eos (the scheduler's per-step stop test asks `Scheduler._check_stop` only on these).
    stop_token_set: frozenset = field(init=False)
    # Its blocks in the KV manager (`KVCacheManager`'s entry, set there when it first holds
    # blocks; None before and once forgotten): the scheduler's per-step loops read it here
    # rather than by request id. Read-only outside the KV manager.
    kv_blocks: Optional[Any] = field(default=None, init=False)

    def __post_init__(self) -> None:
        room = self.max_model_len - len(self.prompt_token_ids)
        p = self.sampling_params
        self.max_tokens = room if p.max_tokens is None else min(p.max_tokens, room)
        self.stop_token_set = frozenset(p.stop_token_ids).union(
            () if p.ignore_eos else self.eos_token_ids)
        self.may_read_output_tokens = (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                                       or p.frequency_penalty != 0.0 or p.min_tokens > 0)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, eos_token_ids: frozenset,
                                 max_model_len: int) -> "Request":
        return cls(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                   sampling_params=req.sampling_params, arrival_time=req.arrival_time,
                   priority=req.priority, cache_salt=req.cache_salt,
                   eos_token_ids=eos_token_ids, max_model_len=max_model_len)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """(prompt + output)[start:end] without concatenating the whole sequence (a block's
        tokens, hashed as it fills: per request per block)."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return prompt[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def sampling_reads_output_tokens(self) -> bool:
        """Sampling its next token reads its output ids on the host: penalties count them and
        min_tokens masks EOS until enough exist. Such a request cannot be sampled while one of its
        tokens is still in flight. (A seeded sample's noise is keyed by the sampled token's index
        in the output, which the runner knows without the ids: it overlaps like any other.)"""
        p = self.sampling_params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0 or self.num_output_tokens < p.min_tokens)

    @property
    def can_speculate(self) -> bool:
        """Its sampling allows verifying several positions in one step: nothing reads the output
        ids on the host (penalties and min_tokens would differ per draft position) and no
        logprobs are asked (they are computed for one sampled row per step, and prompt logprobs
        for prompt rows only)."""
        p = self.sampling_params
        return (not self.sampling_reads_output_tokens and p.logprobs is None
                and p.prompt_logprobs is None)
