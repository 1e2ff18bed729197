"""The worker's record of each request it has been told about (`SchedulerOutput.new_requests`).

One place for a request's token ids, block table and sampling state, kept until the scheduler
says the request finished. The worker appends the tokens it samples itself (`append_sampled`);
the scheduler sends only what changed each step (new block ids, the computed count), never a live
`Request`.
"""

from __future__ import annotations

from operator import attrgetter, lt
from typing import Optional

import numpy as np
import torch

from tinyvllm.scheduling.output import NewRequest
from tinyvllm.worker.sampler import SamplingState

_MIN_ROWS = 16
_MIN_WIDTH = 16


class BlockTables:
    """Every record's block table as a row of one int32 array [rows, width], so that a step's
    tables are one gather (`ModelRunner._fill_host_decodes`) rather than a copy per request;
    beside it each row's prompt length (`prompt_lens`, gathered the same way).
    Rows are handed out as records are made and back when they finish; a row's entries past
    its record's blocks are 0 (the null block), as a step's tables are. The array grows (rows or
    width doubled) when it must, which leaves earlier views stale: take them per use."""

    def __init__(self, width: int = _MIN_WIDTH):
        self.array = np.zeros((_MIN_ROWS, max(width, 1)), dtype=np.int32)
        self.prompt_lens = np.zeros(_MIN_ROWS, dtype=np.int64)
        self._free = list(range(_MIN_ROWS - 1, -1, -1))

    def acquire(self, prompt_len: int = 0) -> int:
        if not self._free:
            rows, width = self.array.shape
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self.prompt_lens = np.concatenate([self.prompt_lens, np.zeros_like(self.prompt_lens)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free.pop()
        self.array[row] = 0
        self.prompt_lens[row] = prompt_len
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def fit_width(self, width: int) -> None:
        rows, have = self.array.shape
        if width > have:
            grown = np.zeros((rows, max(width, 2 * have)), dtype=np.int32)
            grown[:, :have] = self.array
            self.array = grown


class RequestRecords(dict):
    """The worker's records by request id, the block-table rows they hold, and how many have a
    seeded generator (`num_seeded`: a decode step without one skips their sample offsets)."""

    def __init__(self, table_width: int = _MIN_WIDTH):
        super().__init__()
        self.tables = BlockTables(table_width)
        self.num_seeded = 0

    def add(self, new: NewRequest, device: torch.device) -> "CachedRequest":
        self.forget(new.request_id)
        record = self[new.request_id] = CachedRequest(new, device, self.tables)
        self.num_seeded += record.sampling.generator is not None
        return record

    def forget(self, request_id: str) -> None:
        record = self.pop(request_id, None)
        if record is not None:
            self.tables.release(record.row)
            self.num_seeded -= record.sampling.generator is not None


class CachedRequest:
    """Token ids (prompt, then output as sampled here), the block table (a row of the worker's
    `BlockTables`, int32), and the sampling state (a seeded generator lives as long as the
    request, across preemption)."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling",
                 "_tables", "row", "num_blocks", "prompt_logprobs_pos", "prompt_logprobs_end")

    def __init__(self, new: NewRequest, device: torch.device,
                 tables: Optional[BlockTables] = None):
        self.request_id = new.request_id
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.sampling = SamplingState.create(new.sampling_params, self.prompt_token_ids,
                                             self.output_token_ids,
                                             frozenset(new.eos_token_ids), device)
        self._tables = tables if tables is not None else BlockTables()
        self.row = self._tables.acquire(len(self.prompt_token_ids))
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
        return self._tables.array[self.row, :self.num_blocks]

    def set_blocks(self, offset: int, new_block_ids: list[int]) -> None:
        """Cut the table to `offset` entries, then append `new_block_ids` (the scheduler's
        `ScheduledRequest.block_offset` / `new_block_ids`)."""
        if offset > self.num_blocks:
            raise RuntimeError(f"request {self.request_id!r}: block offset {offset} past the "
                               f"{self.num_blocks} blocks this worker knows")
        end = offset + len(new_block_ids)
        if new_block_ids:
            self._tables.fit_width(end)
            self._tables.array[self.row, offset:end] = new_block_ids
        if end < self.num_blocks:  # entries past the table stay 0 (the null block)
            self._tables.array[self.row, end:self.num_blocks] = 0
        self.num_blocks = end

    def clear_blocks(self) -> None:
        """Preempted: its blocks are gone."""
        self.set_blocks(0, [])

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


_request_id = attrgetter("request_id")
_prompt_logprobs_pos = attrgetter("prompt_logprobs_pos")
_prompt_logprobs_end = attrgetter("prompt_logprobs_end")


def prompt_logprobs_due(records: list[CachedRequest]) -> bool:
    """Whether some record has prompt positions left to score (`plan_job`); iterated by `map`,
    as it runs over every request of every step."""
    return any(map(lt, map(_prompt_logprobs_pos, records), map(_prompt_logprobs_end, records)))


def append_sampled(records: list[CachedRequest], tokens: list, lengths: list[int]) -> None:
    """Append each record's token (or a verification's tokens) where the record still has the
    length its step was launched for; else the step ran behind a verification that fell short,
    and its result for that request is dropped (`Scheduler.update`)."""
    for r, token_ids, length in zip(records, tokens, lengths):  # (per request per step)
        output_token_ids = r.output_token_ids
        if len(r.prompt_token_ids) + len(output_token_ids) == length:
            if isinstance(token_ids, int):
                output_token_ids.append(token_ids)
            else:
                output_token_ids.extend(token_ids)


def apply_scheduler_output(records: RequestRecords, out, device: torch.device
                           ) -> Optional[list[CachedRequest]]:
    """Bring the records up to date with a step's message; returns the scheduled requests'
    records in row order (None for an empty step)."""
    for request_id in out.finished_request_ids:
        records.forget(request_id)
    for request_id in out.preempted_request_ids:
        record = records.get(request_id)
        if record is not None:
            record.clear_blocks()
    for new in out.new_requests:
        records.add(new, device)
    scheduled = out.scheduled
    if not scheduled:
        return None
    rows = list(map(records.get, map(_request_id, scheduled)))
    for s, record in zip(scheduled, rows):  # (per request per step)
        if record is None:
            raise RuntimeError(f"request {s.request_id!r} scheduled before the worker was told "
                               f"of it (no NewRequest)")
        if s.new_block_ids or s.block_offset != record.num_blocks:  # (most decodes: neither)
            record.set_blocks(s.block_offset, s.new_block_ids)
    return rows
