"""Verification of speculative tokens: from the target's logits at each request's k + 1 positions
to the tokens each request keeps (`ops.spec_decode.rejection_sample` does the acceptance).

p for every position is what the plain sampler would sample from (temperature, top-k, top-p,
min-p as `ops.sampling.apply_filters`; one-hot at the argmax for greedy rows), and the noise of
position j is the noise of output token (first index + j): Philox keyed by (seed, index) on CUDA,
the request's generator draws on the reference path (kept in `SamplingState.noise_ahead` when a
rejection leaves them unused). With n-gram drafts (deterministic) each emitted token is then
exactly the token plain sampling emits, so speculation changes how fast tokens come, not which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tinyvllm.ops.sampling import apply_filters, as_int64, kernel_available
from tinyvllm.ops.spec_decode import PLACEHOLDER_TOKEN_ID, rejection_sample
from tinyvllm.scheduling.output import SampledTokens
from tinyvllm.worker.requests import CachedRequest, append_sampled
from tinyvllm.worker.sampler import Sampler, SampledTensors, SamplingState, _to_device


def verify(logits: torch.Tensor, states: list[SamplingState],
           draft_token_ids: list[list[int]]) -> list[list[int]]:
    """The tokens each request keeps: its accepted drafts, then the target's own token.

    Args:
        logits: [T, vocab_size] float32, T = sum(k_b + 1): request b's rows are its last token's
            and its k_b drafts' positions, in order; modified in place.
        states: one per request; `sample_index` is the output index of its first row's token.
        draft_token_ids: one list of k_b >= 1 tokens per request.
    Returns:
        Per request, 1 to k_b + 1 token ids.
    """
    acceptance = launch_acceptance(logits, states, draft_token_ids)
    return acceptance.finish(acceptance.on_device.tolist()
                             if acceptance.on_device is not None else None)


@dataclass
class Acceptance:
    """A verification's acceptance, launched: `on_device` (int64, flat) is what `finish` turns
    into the kept tokens once it is on the host; None when the tokens were computed at once
    (the reference path: `finish` ignores its argument). Greedy: `on_device` is every row's
    argmax, request b's first at `greedy_rows[b]`."""

    on_device: Optional[torch.Tensor]
    finish: Callable[[Optional[list[int]]], list[list[int]]]
    greedy_rows: Optional[list[int]] = None


def launch_acceptance(logits: torch.Tensor, states: list[SamplingState],
                      draft_token_ids: list[list[int]]) -> Acceptance:
    """`verify` without the host sync where the device does the work (same arguments)."""
    num_rows = [len(d) + 1 for d in draft_token_ids]
    if all(s.params.greedy for s in states):  # greedy: compare the drafts with the argmax
        first = [0]
        for n in num_rows[:-1]:
            first.append(first[-1] + n)
        return Acceptance(logits.argmax(dim=-1),
                          lambda argmax: _accept_greedy(argmax, draft_token_ids), first)
    device = logits.device
    probs = _target_probs(logits, states, num_rows)
    drafts = _to_device([t for d in draft_token_ids for t in d], torch.int64, device)
    cu = [0]
    for d in draft_token_ids:
        cu.append(cu[-1] + len(d))
    cu_num_draft = _to_device(cu, torch.int64, device)
    if kernel_available(logits):
        seeds = _to_device(_seeds(states), torch.int64, device)
        offsets = _to_device([s.sample_index for s in states], torch.int64, device)
        out = rejection_sample(probs, drafts, cu_num_draft, seed=seeds, offset=offsets)
        width = out.shape[1]
        return Acceptance(out.reshape(-1).long(), lambda flat: _strip(
            [flat[i:i + width] for i in range(0, len(flat), width)]))
    noise = _reference_noise(probs, states, num_rows)
    kept = _strip(rejection_sample(probs, drafts, cu_num_draft, noise=noise).tolist())
    _keep_unused_noise(noise, states, num_rows, kept)
    return Acceptance(None, lambda _: kept)


def _accept_greedy(argmax: list[int], draft_token_ids: list[list[int]]) -> list[list[int]]:
    kept, row = [], 0
    for drafts in draft_token_ids:
        tokens = []
        for j, target in enumerate(argmax[row:row + len(drafts) + 1]):
            tokens.append(target)
            if j == len(drafts) or target != drafts[j]:
                break
        kept.append(tokens)
        row += len(drafts) + 1
    return kept


def _target_probs(logits: torch.Tensor, states: list[SamplingState],
                  num_rows: list[int]) -> torch.Tensor:
    """p of every row [T, vocab_size]: filtered softmax, one-hot at the argmax for greedy rows."""
    params = [s.params for s, n in zip(states, num_rows) for _ in range(n)]
    device = logits.device
    greedy = _to_device([p.greedy for p in params], torch.bool, device)
    floats = _to_device([[0.0 if p.greedy else p.temperature for p in params],
                         [p.top_p for p in params], [p.min_p for p in params]],
                        logits.dtype, device)
    top_k = (_to_device([p.top_k for p in params], torch.int64, device)
             if any(p.top_k > 0 for p in params) else None)
    top_p = floats[1] if any(p.top_p < 1.0 for p in params) else None
    min_p = floats[2] if any(p.min_p > 0.0 for p in params) else None
    greedy_ids = logits.argmax(dim=-1)
    apply_filters(logits, floats[0], top_k, top_p, min_p)
    probs = logits.softmax(dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(1, greedy_ids.unsqueeze(1), 1.0)
    return torch.where(greedy.unsqueeze(1), one_hot, probs)


def _seeds(states: list[SamplingState]) -> list[int]:
    """Philox keys: the request's seed, else a fresh draw (as the sampler keys its kernel)."""
    fresh = iter(torch.randint(0, 1 << 62, (len(states),)).tolist())
    return [as_int64(s.params.seed) if s.params.seed is not None else next(fresh)
            for s in states]


def _reference_noise(probs: torch.Tensor, states: list[SamplingState],
                     num_rows: list[int]) -> torch.Tensor:
    """Exp(1) noise of every row: fresh, or the seeded request's draws by output index."""
    noise = torch.empty_like(probs).exponential_()
    row = 0
    for s, n in zip(states, num_rows):
        if s.generator is not None and not s.params.greedy:
            for j in range(n):
                s.exponential_noise(s.sample_index + j, noise[row + j])
        row += n
    return noise


def _keep_unused_noise(noise: torch.Tensor, states: list[SamplingState], num_rows: list[int],
                       kept: list[list[int]]) -> None:
    """Seeded rows past the emitted tokens drew noise that later output tokens will use."""
    row = 0
    for s, n, tokens in zip(states, num_rows, kept):
        if s.generator is not None and not s.params.greedy:
            for j in range(len(tokens), n):
                s.noise_ahead[s.sample_index + j] = noise[row + j].clone()
        row += n


def _strip(rows: list[list[int]]) -> list[list[int]]:
    return [[t for t in r if t != PLACEHOLDER_TOKEN_ID] for r in rows]


def _split_rows(requests: list[CachedRequest], draft_token_ids: list[list[int]]):
    """The plain requests and their logits rows, the speculative ones (with their drafts) and
    theirs."""
    plain_rows, spec_rows, row = [], [], 0
    plain, spec = [], []
    for r, drafts in zip(requests, draft_token_ids):
        if drafts:
            spec.append((r, drafts))
            spec_rows.extend(range(row, row + len(drafts) + 1))
        else:
            plain.append(r)
            plain_rows.append(row)
        row += len(drafts) + 1
    return plain, plain_rows, spec, spec_rows


class PendingVerification:
    """A step with speculative requests, launched without a host sync: plain rows go through the
    sampler and speculative ones through the acceptance, on the device, and their token ids are
    queued for the host in one copy (`ids_buffer`, pinned; CUDA). `result()` waits for the copy,
    finishes the acceptance on the host and appends every request's tokens to its record, so
    results are taken in step order even when the next step was launched first (prompt-lookup
    drafts scheduled behind a token in flight). Under tensor parallelism every rank keeps rank
    0's tokens: one broadcast, which the runner reaches in step order by taking the result at
    once (`tp`).

    Args:
        logits: [rows, vocab_size] float32, the sampled requests' rows in order (a request with
            k drafts has k + 1); modified in place.
        requests, draft_token_ids: the step's sampled requests and their drafts (empty: plain).
    """

    def __init__(self, logits: torch.Tensor, requests: list[CachedRequest],
                 draft_token_ids: list[list[int]], sampler: Sampler, tp, lengths: list[int],
                 ids_buffer: Optional[torch.Tensor] = None):
        self._requests = requests
        self._lengths = lengths
        self._tp = tp
        self._device = device = logits.device
        plain, plain_rows, spec, spec_rows = _split_rows(requests, draft_token_ids)
        self._plain, self._spec = plain, spec
        self._plain_states = [r.sampling for r in plain]
        sampled = None
        if plain:
            rows = logits[_to_device(plain_rows, torch.int64, device)]
            sampled = sampler.sample(rows, self._plain_states)
            logits = logits[_to_device(spec_rows, torch.int64, device)]
        self._acceptance = launch_acceptance(logits, [r.sampling for r, _ in spec],
                                             [d for _, d in spec])
        parts = [t for t in (sampled.token_ids if sampled else None,
                             self._acceptance.on_device) if t is not None]
        self._logprobs = sampled.logprobs if sampled is not None else None
        self._ids: Optional[torch.Tensor] = None
        self._ready: Optional[torch.cuda.Event] = None
        self._device_ids: Optional[torch.Tensor] = None
        if parts:
            ids = self._device_ids = parts[0] if len(parts) == 1 else torch.cat(parts)
            if device.type == "cuda":
                host = SampledTensors(ids, self._logprobs).to_pinned_host(ids_buffer)
                ids, self._logprobs = host.token_ids, host.logprobs
                self._ready = torch.cuda.Event()
                self._ready.record()
            self._ids = ids

    def last_tokens(self) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
        """Where each request's last token of this step lies on the device, with its position,
        for the next step's inputs: a plain row's sample, and a greedy verification's argmax
        at its last row, which is its last token if every draft is accepted (a step scheduled
        behind it assumes so). Returns (ids, request id -> (row in ids, position))."""
        length = {r.request_id: n for r, n in zip(self._requests, self._lengths)}
        rows = {r.request_id: (i, length[r.request_id]) for i, r in enumerate(self._plain)}
        if self._acceptance.greedy_rows is not None:
            n = len(self._plain)
            for (r, drafts), row in zip(self._spec, self._acceptance.greedy_rows):
                rows[r.request_id] = (n + row + len(drafts), length[r.request_id] + len(drafts))
        ids = self._device_ids
        return (ids if ids is not None else torch.empty(0, dtype=torch.int64)), rows

    def result(self) -> SampledTokens:
        if self._ready is not None:
            self._ready.synchronize()
        ids = self._ids.tolist() if self._ids is not None else []
        n = len(self._plain)
        plain_tokens, plain_logprobs = ids[:n], [None] * n
        if self._logprobs is not None:
            out = SampledTensors(torch.tensor(plain_tokens), self._logprobs).to_output(
                self._plain_states)
            plain_logprobs = out.logprobs
        kept = self._acceptance.finish(ids[n:] if self._acceptance.on_device is not None
                                       else None)
        if self._tp.size > 1:
            plain_tokens, kept = _broadcast_tokens(self._tp, plain_tokens, kept, self._device)
        result: SampledTokens = {r.request_id: (t, lp) for r, t, lp in
                                 zip(self._plain, plain_tokens, plain_logprobs)}
        result.update({r.request_id: (tokens, None) for (r, _), tokens in zip(self._spec, kept)})
        append_sampled(self._requests, [result[r.request_id][0] for r in self._requests],
                       self._lengths)
        return result


def _broadcast_tokens(tp, plain: list[int], kept: list[list[int]], device: torch.device
                      ) -> tuple[list[int], list[list[int]]]:
    """Rank 0's tokens of a verification step on every rank: one [rows, width] int64
    broadcast, -1 past each row's end (plain rows first, one token each)."""
    rows = [[t] for t in plain] + kept
    width = max(len(r) for r in rows)
    table = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    table = tp.broadcast(table.to(device), src=0).cpu()
    rows = [[t for t in row if t >= 0] for row in table.tolist()]
    return [r[0] for r in rows[:len(plain)]], rows[len(plain):]
