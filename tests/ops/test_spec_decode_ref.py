"""The acceptance-sampling reference (ops/spec_decode.py) on CPU: exact outcomes on hand-made
cases, and the distribution over many draws (a chi-square test that the emitted tokens are
distributed as p, and that tokens with p = 0 never appear)."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops.sampling import apply_filters
from tinyvllm.ops.spec_decode import PLACEHOLDER_TOKEN_ID, rejection_sample, rejection_sample_ref

# 99.9th percentiles of chi-square with 1..8 degrees of freedom: a correct sampler fails once in
# 1000 seeds; the seeds are fixed, so a pass stays a pass.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}
NUM_DRAWS = 1_000_000


def one_hot(ids: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_rows_compare_the_draft_with_the_argmax():
    # Request 0 drafts [2, 3, 1]: the target's argmax is 2, 3, 0 -> accepts 2, 3 and emits 0.
    # Request 1 drafts [4]: the target agrees -> the bonus row's argmax 1 follows.
    # Request 2 drafts [0, 0]: the first disagrees -> the target's 3 alone.
    vocab = 5
    probs = one_hot([2, 3, 0, 4, 4, 1, 3, 0, 0], vocab)
    drafts = torch.tensor([2, 3, 1, 4, 0, 0])
    cu = torch.tensor([0, 3, 4, 6])
    out = rejection_sample(probs, drafts, cu, noise=torch.ones(9, vocab))
    assert out.tolist() == [[2, 3, 0, -1], [4, 1, -1, -1], [3, -1, -1, -1]]


def test_deterministic_drafts_emit_what_plain_sampling_emits():
    """With q one-hot, every emitted token is argmax(p / E) of its row: the token that sampling
    each position alone with the same noise gives."""
    torch.manual_seed(0)
    vocab, num_reqs, k = 50, 64, 3
    probs = torch.randn(num_reqs * (k + 1), vocab).mul(3).softmax(-1)
    noise = torch.empty_like(probs).exponential_()
    plain = (probs / noise).argmax(-1).view(num_reqs, k + 1)
    drafts = plain[:, :k].clone()
    drafts[::2, 1] = (drafts[::2, 1] + 1) % vocab  # even requests: the second draft is wrong
    out = rejection_sample_ref(probs, drafts.reshape(-1), torch.arange(0, num_reqs * k + 1, k),
                               None, noise, None)
    assert out[1::2].tolist() == plain[1::2].tolist()  # all accepted, then the bonus
    assert out[::2, :2].tolist() == plain[::2, :2].tolist()
    assert (out[::2, 2:] == PLACEHOLDER_TOKEN_ID).all()


def test_reference_needs_noise():
    with pytest.raises(ValueError, match="^noise"):
        rejection_sample(torch.ones(2, 3) / 3, torch.tensor([1]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="uniform"):
        rejection_sample(torch.ones(2, 3) / 3, torch.tensor([1]), torch.tensor([0, 1]),
                         torch.ones(1, 3) / 3, noise=torch.ones(2, 3))


def test_general_q_accepts_with_probability_min_one_p_over_q():
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    q = torch.tensor([[0.4, 0.6]])
    # draft 0: p/q = 0.5 -> u = 0.49 accepts, u = 0.51 rejects (recovered: the only residual, 1)
    for u, expected in ((0.49, [0, 0]), (0.51, [1, -1])):
        noise = torch.tensor([[1.0, 1.0], [1.0, 2.0]])
        out = rejection_sample_ref(p, torch.tensor([0]), torch.tensor([0, 1]), q, noise,
                                   torch.tensor([u]))
        assert out.tolist() == [expected]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support].double() * counts.sum()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def truncated_target(vocab: int, seed: int) -> torch.Tensor:
    """A row of p after top-k 6 and top-p 0.95 (the filters the sampler applies): zeros kept."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=g) * 1.5
    apply_filters(logits, torch.tensor([0.8]), torch.tensor([6]), torch.tensor([0.95]), None)
    return logits.softmax(-1)[0]


@pytest.mark.parametrize("draft", ["one_hot", "distribution"])
def test_emitted_tokens_are_distributed_as_p(draft):
    """One draft per request. The first emitted token (the accepted draft or the recovered one)
    is distributed as p0, and the bonus token after an acceptance as p1; tokens with p = 0 are
    never emitted."""
    vocab = 10
    p0, p1 = truncated_target(vocab, 1), truncated_target(vocab, 2)
    assert (p0 == 0).any() and (p1 == 0).any()
    g = torch.Generator().manual_seed(3)
    q = torch.tensor([0.05, 0.3, 0.0, 0.1, 0.05, 0.2, 0.1, 0.1, 0.05, 0.05])
    n = NUM_DRAWS
    if draft == "one_hot":  # the draft token is the same fixed guess every time
        drafts = torch.full((n,), int(p0.argmax()) + 1 if p0.argmax() + 1 < vocab else 0)
        draft_probs = None
    else:  # the draft token is drawn from q, which gives mass where p has none
        drafts = torch.multinomial(q, n, replacement=True, generator=g)
        draft_probs = q.expand(n, vocab)
    target = torch.stack([p0, p1]).repeat(n, 1)  # rows: request b's positions 0 and 1
    noise = torch.empty(2 * n, vocab).exponential_(generator=g)
    uniform = torch.rand(n, generator=g)
    out = rejection_sample_ref(target, drafts, torch.arange(n + 1), draft_probs, noise, uniform)
    first = out[:, 0]
    stat, dof = chi_square(torch.bincount(first, minlength=vocab), p0)
    assert stat < CHI2_CRIT[dof], (stat, dof)
    assert (p0[first] > 0).all()
    bonus = out[:, 1][out[:, 1] != PLACEHOLDER_TOKEN_ID]
    assert bonus.numel() > n // 20
    stat, dof = chi_square(torch.bincount(bonus, minlength=vocab), p1)
    assert stat < CHI2_CRIT[dof], (stat, dof)
    assert (p1[bonus] > 0).all()
