"""CUDA acceptance-sampling kernel against the torch reference (ops/spec_decode.py).

With explicit noise (and uniforms) the kernel must emit exactly the reference's tokens. With
Philox, a deterministic draft's emitted tokens are those that the sampling kernel draws for the
same (seed, output index), and frequencies match p.
"""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops._dispatch import cuda_ops
from tinyvllm.ops.sampling import sample
from tinyvllm.ops.spec_decode import PLACEHOLDER_TOKEN_ID, rejection_sample, rejection_sample_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CHI2_CRIT_5 = 20.52  # 99.9th percentile of chi-square with 5 degrees of freedom


@pytest.fixture(scope="module")
def kernels():
    module = cuda_ops()
    assert module is not None and hasattr(module, "rejection_sample"), "tinyvllm._cuda not built"
    return module


def ragged_case(num_reqs: int, vocab: int, max_k: int, seed: int):
    """Random p (peaked, so that drafts are often right), ragged k (0 included), drafts that
    copy the race's winner most of the time."""
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, max_k + 1, (num_reqs,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), ks.cumsum(0)])
    rows = int(cu[-1]) + num_reqs
    probs = (torch.randn(rows, vocab, generator=g) * 4).softmax(-1)
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    winners = (probs / noise).argmax(-1)
    req = torch.repeat_interleave(torch.arange(num_reqs), ks)
    draft_rows = torch.arange(int(cu[-1])) + req
    drafts = winners[draft_rows].clone()
    wrong = torch.rand(drafts.shape, generator=g) < 0.2
    drafts[wrong] = torch.randint(0, vocab, (int(wrong.sum()),), generator=g)
    return probs, drafts, cu, noise


@pytest.mark.parametrize("num_reqs, vocab, max_k", [(1, 7, 1), (13, 1000, 4), (64, 49152, 5)])
@pytest.mark.parametrize("with_q", [False, True])
def test_kernel_matches_reference_with_given_noise(kernels, num_reqs, vocab, max_k, with_q):
    probs, drafts, cu, noise = ragged_case(num_reqs, vocab, max_k, seed=num_reqs + vocab)
    q = uniform = None
    if with_q:
        g = torch.Generator().manual_seed(7)
        q = (torch.randn(drafts.numel(), vocab, generator=g) * 4).softmax(-1)
        uniform = torch.rand(drafts.numel(), generator=g)
    expected = rejection_sample_ref(probs, drafts, cu, q, noise, uniform)
    dev = [t.cuda() if t is not None else None for t in (probs, drafts, cu, q, noise, uniform)]
    out = rejection_sample(dev[0], dev[1], dev[2], dev[3], noise=dev[4], uniform=dev[5])
    assert out.cpu().tolist() == expected.tolist()


def test_philox_draws_are_the_sampling_kernels(kernels):
    """Deterministic drafts: position j emits the token `sample` draws for output index
    offset + j with the same seed (row by row, all drafts wrong after the first)."""
    vocab, num_reqs = 4096, 8
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(num_reqs * 2, vocab, generator=g) * 3).cuda()
    seeds = torch.randint(0, 1 << 62, (num_reqs,), generator=g).cuda()
    offsets = torch.randint(0, 1000, (num_reqs,), generator=g).cuda()
    row_seed, row_offset = seeds.repeat_interleave(2), offsets.repeat_interleave(2)
    row_offset[1::2] += 1
    plain = sample(logits.clone(), torch.ones(num_reqs * 2, device="cuda"), seed=row_seed,
                   offset=row_offset)
    probs = logits.softmax(-1)
    drafts = plain[0::2].clone()  # right: accepted, then the bonus must be plain[1::2]
    out = rejection_sample(probs, drafts, torch.arange(num_reqs + 1, device="cuda"),
                           seed=seeds, offset=offsets)
    assert out.tolist() == torch.stack([plain[0::2], plain[1::2]], 1).tolist()
    wrong = (plain[0::2] + 1) % vocab
    out = rejection_sample(probs, wrong, torch.arange(num_reqs + 1, device="cuda"),
                           seed=seeds, offset=offsets)
    assert out[:, 0].tolist() == plain[0::2].tolist()
    assert (out[:, 1] == PLACEHOLDER_TOKEN_ID).all()


def test_philox_frequencies_equal_p(kernels):
    vocab, n = 8, 1_000_000
    p = torch.tensor([0.3, 0.0, 0.25, 0.2, 0.0, 0.15, 0.05, 0.05])
    target = p.repeat(2 * n, 1).cuda()
    drafts = torch.full((n,), 2, device="cuda")
    out = rejection_sample(target, drafts, torch.arange(n + 1, device="cuda"),
                           seed=torch.arange(n, device="cuda"),
                           offset=torch.zeros(n, dtype=torch.int64, device="cuda"))
    counts = torch.bincount(out[:, 0].cpu(), minlength=vocab).double()
    support = p > 0
    expected = p[support].double() * n
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    assert stat < CHI2_CRIT_5 and counts[~support].sum() == 0
