"""What the scheduler tells the workers each step: plain data, msgspec-encodable.

vLLM's `SchedulerOutput` shape. A request is sent whole once (`NewRequest`: prompt, sampling
parameters, EOS ids) and afterwards only by what changed; the worker keeps one record per request
(its token ids, block table and sampling state) and appends the tokens it samples itself. The
scheduler never sends a live `Request`, so the same message drives an in-process model runner or
worker processes on several GPUs (`engine/executor.py`).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Optional, Union

import msgspec

from tinyvllm.sampling_params import SamplingParams
from tinyvllm.scheduling.request import Logprobs


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the workers have not seen: created in their records on arrival."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's share of a step, as it stood when scheduled. Made for every request every
    step, and never part of a reference cycle (it holds ids and counts): untracked by the
    cyclic collector (gc=False), which otherwise runs several times a step at large batches.

    The worker's block table for the request is cut to `block_offset` entries, then extended by
    `new_block_ids`: a fresh or resumed (preempted) request has offset 0 and its whole table; a
    running one the blocks allocated this step at the end of its table (after a speculative
    rollback freed blocks, the offset drops below the worker's length and cuts them).
    """

    request_id: str
    num_new_tokens: int
    num_computed_tokens: int  # before this step: the position of its first token
    # After this step the request has no uncomputed token: its last position is sampled.
    completes_sequence: bool
    block_offset: int = 0
    new_block_ids: list[int] = []
    # Speculative decoding: the tokens proposed after the request's last one, computed at
    # positions num_computed_tokens + 1 ... (num_new_tokens = 1 + len(draft_token_ids)).
    draft_token_ids: list[int] = []
    # Draft-model speculation: after this step the worker drafts this many tokens after the
    # request's last one, for the scheduler to verify next step. Their KV slots (positions up to
    # num_computed_tokens + num_new_tokens + num_lookahead_tokens - 1) are allocated with the
    # step's; `Scheduler.update` frees the ones past the computed tokens.
    num_lookahead_tokens: int = 0


_num_new_tokens = attrgetter("num_new_tokens")


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step. `scheduled` is in batch-row order; `new_requests` precede their first
    scheduling; finished ids are the requests to forget (their blocks are free); preempted ids
    lost their blocks but keep their records (tokens and sampling state: a seeded request resumes
    its random stream)."""

    step_id: int = 0
    new_requests: list[NewRequest] = []
    scheduled: list[ScheduledRequest] = []
    finished_request_ids: list[str] = []
    preempted_request_ids: list[str] = []

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(map(_num_new_tokens, self.scheduled))  # (map: per request per step)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


SampledTokens = dict[str, tuple[Union[int, list[int]], Optional[Logprobs]]]
"""What a step returns to the scheduler (rank 0's): request id -> (sampled token id, its logprobs
when asked), for the requests whose sequence the step completed; for a request that speculated,
(the tokens it keeps: accepted drafts, then the target's own; None)."""


DraftTokens = dict[str, list[int]]
"""Draft-model speculation (rank 0's): request id -> the tokens the draft model proposes after the
request's last token, for the requests scheduled with `num_lookahead_tokens`; the scheduler
verifies them in the request's next step."""


PromptLogprobs = dict[str, list[Optional[Logprobs]]]
"""Prompt logprobs a step computed (rank 0's): request id -> the logprobs of the prompt tokens
whose preceding position the step computed, in prompt order, None first for the first prompt
token; only requests with `SamplingParams.prompt_logprobs`, each prompt token reported once (a
recomputation after preemption reports nothing again)."""
