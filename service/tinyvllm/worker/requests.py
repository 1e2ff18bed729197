"""The worker's record of each request it has been told about (`SchedulerOutput.new_requests`).

One place for a request's token ids, block table and sampling state, kept until the scheduler
says the request finished. The worker appends the tokens it samples itself (`append_sampled`);
the scheduler sends only what changed each step (new block ids, the computed count), never a live
`Request`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tinyvllm.scheduling.output import NewRequest
from tinyvllm.worker.sampler import SamplingState

_MIN_TABLE = 16


class CachedRequest:
    """Token ids (prompt, then output as sampled here), the block table as int32, and the
    sampling state (a seeded generator lives as long as the request, across preemption)."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling",
                 "_table", "num_blocks", "prompt_logprobs_pos", "prompt_logprobs_end")

    def __init__(self, new: NewRequest, device: torch.device):
        self.request_id = new.request_id
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.sampling = SamplingState.create(new.sampling_params, self.prompt_token_ids,
                                             self.output_token_ids,
                                             frozenset(new.eos_token_ids), device)
        self._table = np.zeros(_MIN_TABLE, dtype=np.int32)
        self.num_blocks = 0
        # Prompt logprobs (worker/prompt_logprobs.py): the next position whose logits score a
        # prompt token (-1: the first token's None is still to report), up to the prompt's last
        # position but one; both 0 when the request does not ask, so one compare skips it.
        wants = new.sampling_params.prompt_logprobs is not None
        self.prompt_logprobs_pos = -1 if wants else 0
        self.prompt_logprobs_end = len(self.prompt_token_ids) - 1 if wants else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def block_table(self) -> np.ndarray:
        """[num_blocks] int32, the request's blocks in sequence order (a view)."""
        return self._table[:self.num_blocks]

    def set_blocks(self, offset: int, new_block_ids: list[int]) -> None:
        """Cut the table to `offset` entries, then append `new_block_ids` (the scheduler's
        `ScheduledRequest.block_offset` / `new_block_ids`)."""
        if offset > self.num_blocks:
            raise RuntimeError(f"request {self.request_id!r}: block offset {offset} past the "
                               f"{self.num_blocks} blocks this worker knows")
        end = offset + len(new_block_ids)
        if end > len(self._table):
            grown = np.zeros(max(end, 2 * len(self._table)), dtype=np.int32)
            grown[:offset] = self._table[:offset]
            self._table = grown
        self._table[offset:end] = new_block_ids
        self.num_blocks = end

    def token_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """Token ids [start, end) of prompt + output without concatenating the whole sequence."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return np.asarray(self.output_token_ids[start - p:end - p], dtype=np.int64)
        if end <= p:
            return np.asarray(self.prompt_token_ids[start:end], dtype=np.int64)
        return np.asarray(self.prompt_token_ids[start:] + self.output_token_ids[:end - p],
                          dtype=np.int64)

    def append_sampled(self, token_ids: "int | list[int]") -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)


def apply_scheduler_output(records: dict[str, CachedRequest], out, device: torch.device
                           ) -> Optional[list[CachedRequest]]:
    """Bring the records up to date with a step's message; returns the scheduled requests'
    records in row order (None for an empty step)."""
    for request_id in out.finished_request_ids:
        records.pop(request_id, None)
    for request_id in out.preempted_request_ids:
        record = records.get(request_id)
        if record is not None:
            record.num_blocks = 0
    for new in out.new_requests:
        records[new.request_id] = CachedRequest(new, device)
    if not out.scheduled:
        return None
    rows = []
    for s in out.scheduled:
        record = records.get(s.request_id)
        if record is None:
            raise RuntimeError(f"request {s.request_id!r} scheduled before the worker was told "
                               f"of it (no NewRequest)")
        record.set_blocks(s.block_offset, s.new_block_ids)
        rows.append(record)
    return rows
