"""Prompt logprobs (`SamplingParams.prompt_logprobs`): for each prompt token after the first, its
logprob under the model given the tokens before it, its rank and the top-n alternatives.

Prompt token i is scored by the logits at position i - 1, so a prefill chunk over positions
[start, start + n) scores prompt tokens start + 1 ... start + n (those that exist); the last
position of one chunk scores the first token of the next. The worker's record keeps the next
position to score (`CachedRequest.prompt_logprobs_pos`), so a prompt recomputed after preemption
is not scored twice. A chunk's logits are computed in pieces of at most `_PIECE_ELEMENTS` values:
memory stays bounded whatever the chunk and vocabulary sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tinyvllm.scheduling.output import PromptLogprobs
from tinyvllm.scheduling.request import Logprobs
from tinyvllm.worker.sampler import LogprobsTensors

_PIECE_ELEMENTS = 1 << 24
"""Logits values per piece: 64 MiB of float32 (twice that with the log_softmax)."""


@dataclass
class PromptLogprobsJob:
    """One request's prompt rows in a step: batch rows first_row ... first_row + len(target_ids)
    - 1, row k scoring target_ids[k] (the prompt token after its position)."""

    request_id: str
    first_row: int
    target_ids: list[int]
    num_top: int
    with_first: bool  # the prompt's first token (None: nothing before it) is reported first


def plan_job(record, start: int, num_new: int, first_row: int) -> Optional[PromptLogprobsJob]:
    """The rows to score in a chunk of positions [start, start + num_new) whose first token is
    batch row `first_row`, advancing the record's position; None when the chunk scores nothing
    new (a recomputation after preemption)."""
    pos = record.prompt_logprobs_pos
    first = max(pos, 0)
    if first >= start + num_new:
        return None
    if first < start:  # the scheduler takes no prefix-cache hit for these requests
        raise RuntimeError(f"request {record.request_id!r}: prompt logprobs from position "
                           f"{first} wanted, but the chunk starts at {start}")
    end = min(start + num_new, record.prompt_logprobs_end)
    record.prompt_logprobs_pos = end
    return PromptLogprobsJob(record.request_id, first_row + first - start,
                             record.prompt_token_ids[first + 1:end + 1],
                             record.sampling.params.prompt_logprobs, with_first=pos < 0)


@dataclass
class StepPromptLogprobs:
    """A step's prompt logprobs where they were computed (no host sync taken yet): the rows of
    every job in job order; tensors is None when no job has a row (one-token prompts)."""

    jobs: list[PromptLogprobsJob]
    tensors: Optional[LogprobsTensors]

    def to_pinned_host(self) -> "StepPromptLogprobs":
        """Queue non-blocking copies into pinned host memory (CUDA); done once an event recorded
        after this call has completed."""
        if self.tensors is None:
            return self
        def copy(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        return StepPromptLogprobs(self.jobs, self.tensors.map(copy))

    def to_lists(self) -> PromptLogprobs:
        """Per request, its Logprobs in prompt order (one transfer per tensor)."""
        t = self.tensors
        lps, ranks, top_lps, top_ids = ((t.token_logprobs.tolist(), t.ranks.tolist(),
                                         t.top_logprobs.tolist(), t.top_token_ids.tolist())
                                        if t is not None else ([], [], [], []))
        result: PromptLogprobs = {}
        row = 0
        for job in self.jobs:
            n = job.num_top
            entries: list[Optional[Logprobs]] = [None] if job.with_first else []
            for i, token_id in enumerate(job.target_ids, row):
                entries.append(Logprobs(token_id, lps[i], ranks[i], top_ids[i][:n],
                                        top_lps[i][:n]))
            row += len(job.target_ids)
            result[job.request_id] = entries
        return result


def compute_prompt_logprobs(jobs: list[PromptLogprobsJob],
                            row_logits: Callable[[int, int], torch.Tensor], vocab_size: int,
                            device: torch.device) -> StepPromptLogprobs:
    """Score every job's rows, a piece of rows at a time.

    Args:
        row_logits: (first, end) -> float32 logits [end - first, vocab_size] of batch rows
            [first, end).
    """
    num_rows = sum(len(j.target_ids) for j in jobs)
    if num_rows == 0:
        return StepPromptLogprobs(jobs, None)
    targets = torch.tensor([t for j in jobs for t in j.target_ids], dtype=torch.int64)
    targets = targets.to(device, non_blocking=True)  # [num_rows]
    max_n = max(j.num_top for j in jobs)
    piece = max(1, _PIECE_ELEMENTS // vocab_size)
    parts, row = [], 0
    for job in jobs:
        for a in range(0, len(job.target_ids), piece):
            b = min(a + piece, len(job.target_ids))
            logprobs = torch.log_softmax(row_logits(job.first_row + a, job.first_row + b), dim=-1)
            parts.append(_score(logprobs, targets[row + a:row + b], max_n))
        row += len(job.target_ids)
    if len(parts) == 1:
        return StepPromptLogprobs(jobs, parts[0])
    return StepPromptLogprobs(jobs, LogprobsTensors(
        torch.cat([p.token_logprobs for p in parts]), torch.cat([p.ranks for p in parts]),
        torch.cat([p.top_logprobs for p in parts]), torch.cat([p.top_token_ids for p in parts])))


def _score(logprobs: torch.Tensor, targets: torch.Tensor, max_n: int) -> LogprobsTensors:
    """Each row's target logprob and rank (1 = best), and its top max_n.

    Shape: logprobs [rows, vocab_size]; targets [rows].
    """
    token_logprobs = logprobs.gather(1, targets.unsqueeze(1))  # [rows, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(max_n, dim=-1)
    return LogprobsTensors(token_logprobs.squeeze(1), ranks, top_logprobs, top_ids)
