"""The sampling reference (ops/sampling.py) on CPU: Philox known answers, the host copy of the
kernel's noise, and the reference pipeline's contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinyvllm.ops.sampling import (apply_filters, as_int64, philox4x32, philox_exponential,
                                   sample, sample_ref)

# Random123's kat_vectors, "philox4x32 10": counter, key -> output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox4x32_10_known_answers(counter, key, expected):
    out = philox4x32(np.array([counter], dtype=np.uint32), key)
    assert tuple(int(x) for x in out[0]) == expected


def test_philox_exponential_layout_and_keys():
    seed, offset, vocab = (1 << 63) + 12345, (3 << 32) + 7, 10
    noise = philox_exponential(seed, offset, vocab)
    counter = np.array([[g, 0, offset & 0xFFFFFFFF, offset >> 32] for g in range(3)],
                       dtype=np.uint32)
    words = philox4x32(counter, (seed & 0xFFFFFFFF, seed >> 32)).reshape(-1)[:vocab]
    u = ((words >> 9).astype(np.float64) * 2 + 1) / 2**24
    assert noise.tolist() == torch.from_numpy(-np.log(u)).float().tolist()
    assert torch.equal(noise, philox_exponential(seed, offset, vocab))
    assert not torch.equal(noise, philox_exponential(seed + 1, offset, vocab))
    assert not torch.equal(noise, philox_exponential(seed, offset + 1, vocab))
    assert torch.equal(philox_exponential(seed, offset, 7), noise[:7])


def test_philox_exponential_is_exp1():
    noise = philox_exponential(2024, 0, 200_000).double()
    assert (noise > 0).all()
    assert abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.02
    # P(E > 2) = e^-2
    assert abs((noise > 2).double().mean().item() - np.exp(-2)) < 0.003


def test_as_int64_keeps_the_low_64_bits():
    assert as_int64(5) == 5
    assert as_int64((1 << 64) - 1) == -1
    assert as_int64(1 << 63) == -(1 << 63)
    assert as_int64(-2) == -2


def test_reference_needs_noise_and_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 5.0]])
    temperature = torch.tensor([0.0, 0.0])
    with pytest.raises(ValueError, match="^noise"):
        sample(logits.clone(), temperature)
    noise = torch.ones_like(logits)
    assert sample_ref(logits.clone(), temperature, None, None, None, noise).tolist() == [1, 0]


def test_filters_off_values_and_top_p_over_the_top_k_survivors():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().repeat(4, 1)
    temperature = torch.ones(4)
    top_k = torch.tensor([0, -1, 3, 2])     # 0 and -1: off
    top_p = torch.tensor([1.0, 0.6, 0.7, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.9])
    apply_filters(logits, temperature, top_k, top_p, min_p)
    assert torch.isfinite(logits).tolist() == [
        [True, True, True, True],    # nothing on
        [True, True, False, False],  # 0.4 < 0.6, 0.4 + 0.3 reaches it
        [True, True, False, False],  # top-3 renormalised: 4/9 < 0.7 <= 7/9
        [True, False, False, False],  # top-2, then 0.3 < 0.9 * 0.4
    ]
