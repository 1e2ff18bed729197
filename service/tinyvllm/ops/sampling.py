"""Sampling after penalties: greedy, temperature, top-k, top-p, min-p and the exponential race.

One reference (torch, the CPU path) and one CUDA kernel (`cuda/sampling.cuh`), with the same
semantics, per row:

    greedy rows (temperature 0): argmax of the logits (ties -> lowest index)
    others: logits / temperature
            ├─ top-k (k <= 0 or k >= vocab_size: off) ┐ both on the temperature-scaled logits;
            ├─ top-p (1.0: off; the smallest set of   ┘ top-p over the top-k survivors
            │         most likely tokens whose mass reaches top_p; the top token survives)
            ├─ min-p (0: off; drop p < min_p * max p over the survivors)
            └─ exponential race: argmax(p / E) with E ~ Exp(1) per token  (no host sync)

The reference sorts the vocabulary; the kernel does not (radix select over the float bits, see
cuda/NOTES.md). Noise: the reference takes an explicit Exp(1) tensor; the kernel draws its own from
Philox4x32-10 keyed by a per-row seed and counter offset (so a seeded request's sample does not
depend on its batch), or takes the same explicit tensor, which is how the tests compare tokens
exactly. `philox_exponential` reproduces the kernel's draws on the host.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tinyvllm.ops._dispatch import use_kernel

_NEG_INF = float("-inf")


def sample(logits: torch.Tensor, temperature: torch.Tensor,
           top_k: Optional[torch.Tensor] = None, top_p: Optional[torch.Tensor] = None,
           min_p: Optional[torch.Tensor] = None, *, seed: Optional[torch.Tensor] = None,
           offset: Optional[torch.Tensor] = None,
           noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row (see the module docstring for the pipeline).

    A filter passed as None is off for every row. On CUDA the kernel runs and leaves `logits`
    untouched; elsewhere the reference runs and modifies `logits` in place.

    Args:
        logits: [num_rows, vocab_size] float32 (penalties already applied).
        temperature: [num_rows] float32; 0 = greedy.
        top_k: [num_rows] int64 (<= 0 or >= vocab_size: off) or None.
        top_p: [num_rows] float32 in (0, 1] (1: off) or None.
        min_p: [num_rows] float32 in [0, 1] (0: off) or None.
        seed, offset: [num_rows] int64, the kernel's Philox key and counter offset per row (read
            as unsigned 64-bit); required by the kernel unless `noise` is given.
        noise: [num_rows, vocab_size] float32 Exp(1) draws; required by the reference. When given,
            the kernel uses it instead of Philox.
    Returns:
        [num_rows] int64 token ids, on logits' device.
    """
    if kernel_available(logits):
        from tinyvllm.ops.sampling_cuda import sample_cuda
        return sample_cuda(use_kernel("sample", logits), logits, temperature, top_k, top_p, min_p,
                           seed, offset, noise)
    if noise is None:
        raise ValueError("noise: the reference sampler needs an Exp(1) noise tensor")
    return sample_ref(logits, temperature, top_k, top_p, min_p, noise)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of [num_rows, vocab_size] float32 logits (ties -> lowest
    index, a NaN above every number): the kernel's greedy path on CUDA, which splits a row over
    several CTAs (about a quarter of torch's time at 1 row of 128,256), torch elsewhere."""
    kernel = use_kernel("sample", logits)
    if (kernel is not None and logits.dim() == 2 and logits.dtype == torch.float32
            and logits.stride(1) == 1 and 0 < logits.shape[0] and logits.shape[1] > 0):
        from tinyvllm.ops.sampling_cuda import argmax_cuda
        return argmax_cuda(kernel, logits)
    return logits.argmax(dim=-1)


def kernel_available(logits: torch.Tensor) -> bool:
    """Whether `sample` runs the CUDA kernel for these logits (then noise is optional)."""
    kernel = use_kernel("sample", logits)
    return kernel is not None


# ---------------------------------------------------------------------------------------------
# Reference (the CPU path)
# ---------------------------------------------------------------------------------------------


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor,
               top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
               min_p: Optional[torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
    """The torch reference of `sample`; modifies `logits` in place. Same shapes as `sample`."""
    greedy = temperature <= 0
    greedy_ids = logits.argmax(dim=-1)
    apply_filters(logits, temperature, top_k, top_p, min_p)
    sampled = exponential_race(logits.softmax(dim=-1), noise)
    return torch.where(greedy, greedy_ids, sampled)


def apply_filters(logits: torch.Tensor, temperature: torch.Tensor,
                  top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                  min_p: Optional[torch.Tensor]) -> None:
    """Temperature, then top-k / top-p, then min-p, in place: dropped tokens become -inf.

    Greedy rows (temperature <= 0) are divided by 1 so that nothing becomes inf / nan; their
    filtered logits are not used. Shapes as `sample`.
    """
    logits.div_(torch.where(temperature <= 0, torch.ones_like(temperature),
                            temperature).unsqueeze(1))
    vocab_size = logits.shape[1]
    if top_k is not None:
        top_k = torch.where((top_k > 0) & (top_k < vocab_size), top_k,
                            torch.full_like(top_k, vocab_size))
    if top_k is not None or top_p is not None:
        apply_top_k_top_p(logits, top_k, top_p)
    if min_p is not None:
        apply_min_p(logits, min_p)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> None:
    """Mask, in place, the logits outside each row's top-k and outside its top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p; the most
    likely token always survives.

    Shape: logits [num_rows, vocab_size]; top_k [num_rows] int64 (vocab_size = off);
    top_p [num_rows] (1.0 = off).
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        positions = torch.arange(logits.shape[1], device=logits.device)
        drop |= positions.unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        # Rows with top_p = 1 are skipped explicitly: rounding can push the running mass to 1.
        drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False
    logits.scatter_(1, sorted_ids, sorted_logits.masked_fill(drop, _NEG_INF))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask, in place, tokens whose probability is below min_p * the row's top probability.

    Shape: logits [num_rows, vocab_size]; min_p [num_rows] (0 = off).
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, _NEG_INF)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / E) per row: a sample from probs when E holds i.i.d. Exp(1) draws.

    The noise is clamped away from 0 so that a masked token (probability 0) can never win
    with 0 / 0 = nan.

    Shape: probs, noise [num_rows, vocab_size] -> [num_rows] int64.
    """
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# The kernel's noise, on the host
# ---------------------------------------------------------------------------------------------

_MASK32 = 0xFFFF_FFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Random123's Philox4x32 multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # and key increments (golden ratio, sqrt(3) - 1)
PHILOX_ROUNDS = 10


def philox4x32(counter: np.ndarray, key: tuple[int, int], rounds: int = PHILOX_ROUNDS) -> np.ndarray:
    """Philox4x32-R (Salmon et al., SC'11) on a batch of counters.

    Shape: counter [n, 4] uint32 -> [n, 4] uint32; key: two 32-bit words.
    """
    c = [counter[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = c[0] * _PHILOX_M[0], c[2] * _PHILOX_M[1]  # 32 x 32 -> 64 bits, no overflow
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & _MASK32, (p0 >> 32) ^ c[3] ^ k1, p0 & _MASK32]
        k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
    return np.stack(c, axis=1).astype(np.uint32)


def philox_exponential(seed: int, offset: int, vocab_size: int) -> torch.Tensor:
    """The kernel's Exp(1) draw for every token of one row, [vocab_size] float32 (CPU).

    Token i takes word i % 4 of Philox4x32-10 at counter (i // 4, 0, offset lo, offset hi) and
    key (seed lo, seed hi); the word's top 23 bits give u = (2 * bits + 1) / 2^24, exactly
    representable in float32 and never 0 or 1; E = -log(u).
    """
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    num_groups = (vocab_size + 3) // 4
    counter = np.zeros((num_groups, 4), dtype=np.uint32)
    counter[:, 0] = np.arange(num_groups, dtype=np.uint32)
    counter[:, 2], counter[:, 3] = offset & _MASK32, offset >> 32
    words = philox4x32(counter, (seed & _MASK32, seed >> 32)).reshape(-1)[:vocab_size]
    u = ((words >> 9).astype(np.float64) * 2 + 1) / float(1 << 24)
    return torch.from_numpy(-np.log(u)).float()


def as_int64(value: int) -> int:
    """A Python int's low 64 bits as a signed int64 (how seeds and offsets travel to the kernel)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
