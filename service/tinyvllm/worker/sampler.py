"""Turn a step's logits into one token per batch row.

Pipeline, in this order (vLLM's and HF's order, so that the same parameters give the same tokens):

    raw logits ──▶ logprobs (log_softmax of the raw logits, when asked)
        │
        ├─ min_tokens: EOS / stop token ids -> -inf while the output is too short
        ├─ repetition penalty (CTRL): over prompt + output, positive / r, negative * r
        ├─ presence / frequency penalties (OpenAI): over output tokens
        │        └─▶ greedy rows: argmax here (ops.sampling.argmax)
        ├─ temperature                                       ┐ ops.sampling.sample: the CUDA
        ├─ top-k, top-p, min-p                               │ kernel (no sort) or the torch
        └─ softmax, exponential race argmax(probs / Exp(1))  ┘ reference (no host sync either way)

Everything is vectorised over the batch: per-row parameters become [N] tensors; the only per-row
Python loops build those tensors and (reference path) draw seeded rows' noise from their own
generators; the kernel keys its Philox noise by (seed, number of generated tokens). Either way a
seeded sample does not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Optional

import torch

from tinyvllm.scheduling.request import Logprobs
from tinyvllm.ops.sampling import (apply_min_p, apply_top_k_top_p,  # noqa: F401 (re-exported)
                                   argmax, as_int64, kernel_available, sample)
from tinyvllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingState:
    """Per-row sampling state, kept by the model runner across steps.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (for the repetition penalty).
        output_token_ids: the request's live list of generated tokens (read-only here).
        eos_token_ids: the model's EOS ids (suppressed under min_tokens unless ignore_eos).
        generator: the request's own generator when params.seed is set, on the logits' device.
        output_index: index in the output of the token this step samples, set by the model runner
            (with a token in flight it is past len(output_token_ids)); None: the next one known.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()
    generator: Optional[torch.Generator] = None
    output_index: Optional[int] = None
    # Reference path, seeded rows: the generator's draws not used yet, by output index. The n-th
    # draw is the noise of output token n whether it is sampled alone or in a verification step
    # (which draws for all its positions and keeps those past the rejection for later).
    noise_ahead: dict[int, torch.Tensor] = field(default_factory=dict)
    # Greedy, without penalties or logprobs: an argmax once the output has min_tokens (set from
    # the parameters, which never change; read per row per step).
    plain_greedy: bool = field(init=False)
    # ... and without min_tokens: an argmax at every step.
    plain_argmax: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = p.greedy and not self.has_penalties and p.logprobs is None
        self.plain_argmax = self.plain_greedy and p.min_tokens == 0

    def exponential_noise(self, index: int, out: torch.Tensor) -> None:
        """Fill out ([vocab_size]) with the Exp(1) noise of output token `index` from the
        generator (seeded rows): a draw kept from a verification step, else the next draw."""
        kept = self.noise_ahead.pop(index, None)
        for stale in [i for i in self.noise_ahead if i < index]:
            del self.noise_ahead[stale]
        if kept is not None:
            out.copy_(kept)
        else:
            out.exponential_(generator=self.generator)

    @property
    def sample_index(self) -> int:
        """The Philox offset of a seeded sample: the sampled token's index in the output."""
        return len(self.output_token_ids) if self.output_index is None else self.output_index

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: list[int],
               output_token_ids: list[int], eos_token_ids: frozenset[int] = frozenset(),
               device: torch.device | str = "cpu") -> "SamplingState":
        """Build a state, seeding a generator on `device` when params.seed is set."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(params, prompt_token_ids, output_token_ids, eos_token_ids, generator)

    @property
    def needs_min_tokens_mask(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0)


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[Optional[Logprobs]]


@dataclass
class LogprobsTensors:
    """Logprobs of a step's sampled tokens, from the raw model distribution.

    Shape: token_logprobs [num_rows]; ranks [num_rows] int64 (1 = best);
    top_logprobs, top_token_ids [num_rows, max_n] (max_n over the rows that asked).
    """

    token_logprobs: torch.Tensor
    ranks: torch.Tensor
    top_logprobs: torch.Tensor
    top_token_ids: torch.Tensor

    def map(self, fn) -> "LogprobsTensors":
        return LogprobsTensors(fn(self.token_logprobs), fn(self.ranks), fn(self.top_logprobs),
                               fn(self.top_token_ids))


@dataclass
class SampledTensors:
    """A step's samples where they were computed (no host sync taken yet).

    Shape: token_ids [num_rows] int64; logprobs as in LogprobsTensors, None when no row asked.
    """

    token_ids: torch.Tensor
    logprobs: Optional[LogprobsTensors]

    def to_pinned_host(self, ids_buffer: Optional[torch.Tensor] = None) -> "SampledTensors":
        """Queue non-blocking copies into pinned host tensors (CUDA only): the token ids into
        `ids_buffer` (a pinned int64 tensor of at least num_rows, free until the copy's event
        has completed and the result been read) or, like the logprobs, into fresh ones. The
        copies are done once an event recorded after this call has completed."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        ids = (copy(self.token_ids) if ids_buffer is None else
               ids_buffer[:self.token_ids.shape[0]].copy_(self.token_ids, non_blocking=True))
        return SampledTensors(ids, self.logprobs.map(copy) if self.logprobs is not None else None)

    def to_output(self, states: list[SamplingState]) -> SamplerOutput:
        """Python lists, one transfer per tensor (a host sync for device tensors)."""
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return SamplerOutput(token_ids, [None] * len(states))
        return SamplerOutput(token_ids, _logprobs_lists(self.logprobs, token_ids, states))


_plain_argmax = attrgetter("plain_argmax")


class Sampler:
    """Stateless; call it once per step with the batch's logits and states."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample one token per row and bring the result to the host (`sample`, then a sync).

        Args:
            logits: [num_rows, vocab_size] float32 model logits; modified in place.
            states: one per row.
        Returns:
            SamplerOutput with num_rows token ids and logprobs (None for rows that did not ask).
        """
        return self.sample(logits, states).to_output(states)

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SampledTensors:
        """Sample one token per row without a host sync; same arguments as `__call__`."""
        assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        if all(map(_plain_argmax, states)) or all(
                s.plain_greedy and len(s.output_token_ids) >= s.params.min_tokens
                for s in states):  # (no row needs the min_tokens mask)
            return SampledTensors(argmax(logits), None)

        want_logprobs = any(s.params.logprobs is not None for s in states)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        apply_min_tokens(logits, states)
        _apply_batch_penalties(logits, states)
        sampled = _sample(logits, states)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, states)
        return SampledTensors(sampled, logprobs)


# ---------------------------------------------------------------------------------------------
# Logit processors (in place)
# ---------------------------------------------------------------------------------------------


def apply_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Set EOS (unless ignore_eos) and stop token ids to -inf while output < min_tokens.

    Shape: logits [num_rows, vocab_size].
    """
    rows: list[int] = []
    cols: list[int] = []
    vocab_size = logits.shape[1]
    for i, s in enumerate(states):
        if not s.needs_min_tokens_mask:
            continue
        banned = set(s.params.stop_token_ids)
        if not s.params.ignore_eos:
            banned |= s.eos_token_ids
        banned = [t for t in banned if t < vocab_size]
        rows += [i] * len(banned)
        cols += banned
    if rows:
        logits[_index(rows, logits.device), _index(cols, logits.device)] = _NEG_INF


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor,
                    output_token_ids: torch.Tensor, repetition_penalties: torch.Tensor,
                    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor) -> None:
    """Apply repetition, presence and frequency penalties in place.

    Repetition (CTRL / HF): for every token seen in prompt or output, a positive logit is divided
    by the penalty and a negative one multiplied by it. Presence / frequency (OpenAI): over output
    tokens, logit -= frequency * count + presence * (count > 0).

    Shape:
        logits: [num_rows, vocab_size]
        prompt_token_ids: [num_rows, max_prompt_len], padded with vocab_size
        output_token_ids: [num_rows, max_output_len], padded with vocab_size
        repetition_penalties, presence_penalties, frequency_penalties: [num_rows]
    """
    num_rows, vocab_size = logits.shape
    # One spare column collects the padding so that no row needs its own length.
    output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids,
                                                                    dtype=logits.dtype))
    output_counts = output_counts[:, :vocab_size]
    output_seen = output_counts > 0

    prompt_seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    prompt_seen.scatter_(1, prompt_token_ids, True)
    seen = prompt_seen[:, :vocab_size] | output_seen

    rep = repetition_penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * output_seen.to(logits.dtype)


def _apply_batch_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Build the penalty tensors for the rows that have penalties and apply them."""
    rows = [i for i, s in enumerate(states) if s.has_penalties]
    if not rows:
        return
    device, vocab_size = logits.device, logits.shape[1]
    picked = [states[i] for i in rows]
    prompts = _pad([s.prompt_token_ids for s in picked], vocab_size, device)
    outputs = _pad([s.output_token_ids for s in picked], vocab_size, device)
    params = [s.params for s in picked]

    def per_row(name: str) -> torch.Tensor:
        return _to_device([getattr(p, name) for p in params], logits.dtype, device)

    index = _index(rows, device)
    sub = logits[index]
    apply_penalties(sub, prompts, outputs, per_row("repetition_penalty"),
                    per_row("presence_penalty"), per_row("frequency_penalty"))
    logits[index] = sub


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def _sample(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Greedy rows take the argmax; the others go through temperature, filters and the race.

    `ops.sampling.sample` does the work: the CUDA kernel on a GPU (Philox noise keyed by each
    row's seed and output length, no generator, no sync), the torch reference elsewhere (noise
    from the rows' generators).

    Shape: logits [num_rows, vocab_size] (penalised) -> [num_rows] int64.
    """
    params = [s.params for s in states]
    if all(p.greedy for p in params):
        return argmax(logits)
    device = logits.device
    # One pinned upload per dtype; a filter no row uses is passed as None (skipped).
    floats = _to_device([[0.0 if p.greedy else p.temperature for p in params],
                         [p.top_p for p in params], [p.min_p for p in params]],
                        logits.dtype, device)
    top_p = floats[1] if any(p.top_p < 1.0 for p in params) else None
    min_p = floats[2] if any(p.min_p > 0.0 for p in params) else None
    use_top_k = any(p.top_k > 0 for p in params)
    if kernel_available(logits):
        ints = _to_device([[p.top_k for p in params], _philox_seeds(states),
                           [s.sample_index for s in states]], torch.int64, device)
        return sample(logits, floats[0], ints[0] if use_top_k else None, top_p, min_p,
                      seed=ints[1], offset=ints[2])
    top_k = _to_device([p.top_k for p in params], torch.int64, device) if use_top_k else None
    return sample(logits, floats[0], top_k, top_p, min_p,
                  noise=_exponential_noise(logits, states))


def _exponential_noise(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Exp(1) noise like logits, [num_rows, vocab_size]: one shared draw, seeded rows from their
    generator (the reference path)."""
    noise = torch.empty_like(logits).exponential_()
    for i, s in enumerate(states):
        if s.generator is not None and not s.params.greedy:
            s.exponential_noise(s.sample_index, noise[i])
    return noise


def _philox_seeds(states: list[SamplingState]) -> list[int]:
    """Each row's Philox key for the kernel: the request's seed, else a fresh draw from torch's CPU
    generator (host only; torch.manual_seed reproduces a run)."""
    fresh = iter(torch.randint(0, 1 << 62, (len(states),)).tolist())
    return [as_int64(s.params.seed) if s.params.seed is not None else next(fresh) for s in states]


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                     states: list[SamplingState]) -> LogprobsTensors:
    """Sampled token's logprob and rank plus the top-n, from the raw model distribution.

    Shape: raw_logprobs [num_rows, vocab_size]; sampled [num_rows].
    """
    max_n = max(s.params.logprobs or 0 for s in states)
    token_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [num_rows, 1]
    ranks = (raw_logprobs > token_logprobs).sum(dim=-1) + 1  # 1 = best
    top_logprobs, top_ids = raw_logprobs.topk(max_n, dim=-1)
    return LogprobsTensors(token_logprobs.squeeze(1), ranks, top_logprobs, top_ids)


def _logprobs_lists(tensors: LogprobsTensors, token_ids: list[int],
                    states: list[SamplingState]) -> list[Optional[Logprobs]]:
    """Per-row Logprobs (None where the row did not ask); one transfer per tensor."""
    token_lps, ranks = tensors.token_logprobs.tolist(), tensors.ranks.tolist()
    top_lps, top_ids = tensors.top_logprobs.tolist(), tensors.top_token_ids.tolist()
    result: list[Optional[Logprobs]] = []
    for i, s in enumerate(states):
        n = s.params.logprobs
        if n is None:
            result.append(None)
            continue
        result.append(Logprobs(token_id=token_ids[i], logprob=token_lps[i], rank=ranks[i],
                               top_token_ids=top_ids[i][:n], top_logprobs=top_lps[i][:n]))
    return result


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on device without a host sync.

    A copy from pageable memory synchronises the stream first; from pinned memory with
    non_blocking it is queued behind the step's kernels like any other work.
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return _to_device(values, torch.int64, device)


def _pad(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """[len(rows), max(1, longest)] int64, padded with pad_id."""
    width = max(1, max(len(r) for r in rows))
    return _to_device([r + [pad_id] * (width - len(r)) for r in rows], torch.int64, device)
