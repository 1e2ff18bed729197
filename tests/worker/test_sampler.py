"""Sampler: greedy, filters, seeded determinism, distributions, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tinyvllm.errors import InvalidRequestError
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.sampler import (
    Sampler,
    SamplingState,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)

VOCAB_SIZE = 37  # awkward on purpose
EOS_ID = 5


def state(output: list[int] | None = None, prompt: list[int] | None = None,
          eos: frozenset[int] = frozenset({EOS_ID}), **params) -> SamplingState:
    return SamplingState.create(SamplingParams(**params), prompt or [1, 2, 3], output or [], eos)


def random_logits(num_rows: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=g) * 3


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    return Sampler()(logits.clone(), states).token_ids


# ------------------------------------------------------------------ greedy and filters


def test_greedy_is_argmax():
    logits = random_logits(6)
    assert sample(logits, [state(temperature=0.0) for _ in range(6)]) == \
        logits.argmax(-1).tolist()


def test_greedy_rows_mixed_with_random_rows_stay_argmax():
    logits = random_logits(6)
    states = [state(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = sample(logits, states)
    assert out[1::2] == logits.argmax(-1).tolist()[1::2]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature):
    logits = random_logits(8, seed=1)
    states = [state(temperature=temperature, top_k=1) for _ in range(8)]
    for _ in range(5):
        assert sample(logits, states) == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(8, seed=2)
    states = [state(temperature=2.0, top_p=1e-6) for _ in range(8)]
    for _ in range(5):
        assert sample(logits, states) == logits.argmax(-1).tolist()


def test_min_p_masks_exactly_the_unlikely_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    logits = probs.log()
    apply_min_p(logits, torch.tensor([0.25]))  # threshold 0.125
    assert torch.isinf(logits[0, 2:]).all() and torch.isfinite(logits[0, :2]).all()


def test_min_p_sampling_never_draws_masked_tokens():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().expand(4000, -1).contiguous()
    drawn = set(sample(logits, [state(min_p=0.25)] * 4000))
    assert drawn == {0, 1}


def test_top_k_top_p_filter_keeps_the_nucleus():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().repeat(3, 1)
    apply_top_k_top_p(logits, torch.tensor([4, 2, 4]), torch.tensor([0.6, 1.0, 0.75]))
    kept = torch.isfinite(logits).tolist()
    assert kept == [[True, True, False, False],  # 0.4 < 0.6, 0.4 + 0.3 reaches it
                    [True, True, False, False],  # top-2
                    [True, True, True, False]]   # 0.7 < 0.75


# ------------------------------------------------------------------ seeds


def test_seeded_sample_is_independent_of_batch_composition_and_position():
    logits = random_logits(1, seed=3)
    alone = state(seed=1234, temperature=1.0)
    expected = [sample(logits, [alone])[0] for _ in range(20)]

    for position in (0, 3):
        seeded = state(seed=1234, temperature=1.0)
        got = []
        for step in range(20):
            others = [state(temperature=0.7, top_p=0.9) for _ in range(4)]
            others[1] = state(seed=99 + step)  # another seeded row
            states = others[:position] + [seeded] + others[position:]
            batch = torch.cat([random_logits(position, seed=step + 10), logits,
                               random_logits(4 - position, seed=step + 20)])
            got.append(sample(batch, states)[position])
        assert got == expected


def test_seeded_rows_are_reproducible_and_seeds_differ():
    logits = random_logits(1, seed=4, vocab_size=1000).expand(2, -1).contiguous()
    runs = [[sample(logits, [state(seed=s), state(seed=s + 1)]) for _ in range(10)]
            for s in (7, 7)]
    assert runs[0] == runs[1]
    assert [a for a, _ in runs[0]] != [b for _, b in runs[0]]


# ------------------------------------------------------------------ distributions

NUM_DRAWS = 40_000


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draw(logits_row: torch.Tensor, **params) -> torch.Tensor:
    """Counts of NUM_DRAWS samples from one distribution (one batched sampler call)."""
    logits = logits_row.expand(NUM_DRAWS, -1).contiguous()
    torch.manual_seed(0)
    ids = torch.tensor(sample(logits, [state(**params)] * NUM_DRAWS))
    return torch.bincount(ids, minlength=logits_row.numel()).float()


# 99.9th percentile of chi-square with 7 / 2 degrees of freedom: a false failure once in 1000.
CHI2_CRIT_7_DOF = 24.32
CHI2_CRIT_2_DOF = 13.82


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_over_temperature(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    counts = draw(logits, temperature=temperature)
    assert chi_square(counts, (logits / temperature).softmax(-1)) < CHI2_CRIT_7_DOF


@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.6), dict(top_k=4, top_p=0.75)])
def test_filtered_tokens_are_never_drawn_and_the_rest_renormalise(params):
    probs = torch.tensor([0.05, 0.3, 0.02, 0.25, 0.03, 0.2, 0.1, 0.05])
    counts = draw(probs.log(), **params)
    allowed = torch.tensor([1, 3, 5])  # top-3; also the 0.6 and 0.75 nuclei
    mask = torch.zeros(8, dtype=torch.bool)
    mask[allowed] = True
    assert counts[~mask].sum() == 0
    expected = torch.where(mask, probs, torch.zeros_like(probs))
    assert chi_square(counts, expected / expected.sum()) < CHI2_CRIT_2_DOF


# ------------------------------------------------------------------ min_tokens


def test_min_tokens_blocks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, EOS_ID] = 100.0
    logits[0, 9] = 90.0
    logits[0, 11] = 80.0
    blocked = state(output=[1, 2], temperature=0.0, min_tokens=3, stop_token_ids=[9])
    assert sample(logits, [blocked]) == [11]
    free = state(output=[1, 2, 3], temperature=0.0, min_tokens=3, stop_token_ids=[9])
    assert sample(logits, [free]) == [EOS_ID]
    ignoring = state(output=[1], temperature=0.0, min_tokens=3, ignore_eos=True,
                     stop_token_ids=[9])
    assert sample(logits, [ignoring]) == [EOS_ID]  # EOS is not special under ignore_eos


# ------------------------------------------------------------------ penalties


def test_penalties_follow_the_formulas():
    vocab_size = 6
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5, 1.0]])
    prompt = torch.tensor([[0, 1, vocab_size]])  # padded
    output = torch.tensor([[2, 2, 3, vocab_size]])
    rep, presence, frequency = 2.0, 0.5, 0.25
    apply_penalties(logits, prompt, output, torch.tensor([rep]), torch.tensor([presence]),
                    torch.tensor([frequency]))
    expected = [
        2.0 / rep,                                   # prompt, positive
        -1.0 * rep,                                  # prompt, negative
        3.0 / rep - 2 * frequency - presence,        # output twice
        -2.0 * rep - 1 * frequency - presence,       # output once, negative
        0.5,                                         # unseen
        1.0,                                         # unseen
    ]
    assert logits[0].tolist() == pytest.approx(expected)


def test_penalties_steer_greedy_and_leave_other_rows_alone():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    penalised = SamplingState.create(SamplingParams(temperature=0.0, presence_penalty=2.0),
                                     [2], [0])
    plain = SamplingState.create(SamplingParams(temperature=0.0), [2], [0])
    assert sample(logits, [penalised, plain]) == [1, 0]


def test_repetition_penalty_counts_the_prompt():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    s = SamplingState.create(SamplingParams(temperature=0.0, repetition_penalty=1.5), [0], [])
    assert sample(logits, [s]) == [1]


# ------------------------------------------------------------------ logprobs


def test_logprobs_match_log_softmax_of_raw_logits_and_rank_is_right():
    logits = random_logits(3, seed=5)
    states = [state(temperature=1.0, logprobs=4, presence_penalty=1.0, output=[0]),
              state(temperature=0.0, logprobs=0),
              state(temperature=1.0)]
    out = Sampler()(logits.clone(), states)
    reference = logits.log_softmax(-1)
    for row in (0, 1):
        lp = out.logprobs[row]
        token = out.token_ids[row]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[row, token].item())
        assert lp.rank == 1 + int((reference[row] > reference[row, token]).sum())
        values, ids = reference[row].topk(states[row].params.logprobs)
        assert lp.top_token_ids == ids.tolist()
        assert lp.top_logprobs == pytest.approx(values.tolist())
    assert out.logprobs[1].rank == 1  # greedy without penalties takes the best token
    assert out.logprobs[2] is None


def test_logprobs_rank_of_a_forced_unlikely_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    s = state(temperature=1.0, top_k=1, logprobs=2, repetition_penalty=100.0,
              prompt=[0, 1], eos=frozenset())
    out = Sampler()(logits.clone(), [s])
    assert out.token_ids == [2]  # 0 and 1 penalised away, top-1 of the rest
    assert out.logprobs[0].rank == 3
    assert out.logprobs[0].logprob == pytest.approx(logits.log_softmax(-1)[0, 2].item())
    assert out.logprobs[0].top_token_ids == [0, 1]


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("field, value", [
    ("top_p", 1.5), ("top_p", 0.0), ("temperature", -1.0), ("top_k", -2), ("min_p", 2.0),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("logprobs", 21), ("min_tokens", -1), ("max_tokens", 0), ("stop", [""]),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(field)
    assert info.value.field_name == field


def test_temperature_nan_is_rejected():
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams(temperature=math.nan)
