"""CUDA sampling kernel against the torch reference (ops/sampling.py).

With a noise tensor the kernel must pick exactly the reference's token (the reference runs in
float64 so that its own rounding does not decide near-threshold cases). With Philox: the host copy
of the noise gives the same tokens, the token survives the reference's filters, a seeded row's
token does not depend on its batch, and frequencies match the reference probabilities.
"""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops._dispatch import cuda_ops
from tinyvllm.ops.sampling import apply_filters, as_int64, philox_exponential, sample_ref
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.sampler import Sampler, SamplingState

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROWS = [1, 3, 37, 64]
VOCABS = [7, 1000, 32001, 49152, 128256]
SCALES = (0.5, 2.0, 5.0, 12.0)  # flat (large nuclei: the global-memory path) .. peaked rows
# 99.9th percentiles of chi-square with 1..8 degrees of freedom (false failure once in 1000;
# the seeds are fixed, so a pass stays a pass).
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


@pytest.fixture(scope="module")
def kernels():
    module = cuda_ops()
    assert module is not None and hasattr(module, "sample"), "tinyvllm._cuda not built"
    return module


def row_params(kind: str, i: int, vocab: int) -> tuple[float, int, float, float]:
    """(temperature, top_k, top_p, min_p) of row i for a kind of batch; off = 1.0 / 0 / 1.0 / 0."""
    c = i % 4
    if kind == "greedy":
        return 0.0, 0, 1.0, 0.0
    if kind == "temperature":
        return (0.3, 0.7, 1.0, 1.5)[c], 0, 1.0, 0.0
    if kind == "top_k":
        return 0.8, (1, 5, 50, 5000)[c], 1.0, 0.0
    if kind == "top_p":
        return 1.0, 0, (0.5, 0.9, 0.95, 1e-4)[c], 0.0
    if kind == "min_p":
        return 0.9, 0, 1.0, (0.05, 0.2, 0.5, 0.999)[c]
    if kind == "combined":
        return 0.7, (50, 3, 1000, vocab + 1)[c], (0.9, 0.5, 0.99, 0.8)[c], (0.1, 0.0, 0.01, 0.3)[c]
    if kind == "mixed":  # greedy and sampled rows in one batch
        return [(0.0, 0, 1.0, 0.0), (1.0, 20, 0.8, 0.0), (0.6, 0, 1.0, 0.0),
                (1.2, 0, 0.9, 0.05)][c]
    if kind == "extremes":
        return [(1.0, 1, 1.0, 0.0), (1.0, vocab, 1.0, 0.0), (2.0, vocab + 7, 1e-6, 0.0),
                (1.0, 0, 1.0, 0.9999), (1.0, 0, 1.0, 1.0), (0.5, -1, 1.0, 0.0),
                (3.0, 2, 0.9999, 0.0), (1.0, vocab - 1, 0.3, 0.0)][i % 8]
    raise AssertionError(kind)


KINDS = ["greedy", "temperature", "top_k", "top_p", "min_p", "combined", "mixed", "extremes"]


def batch_params(kind: str, rows: int, vocab: int) -> dict[str, torch.Tensor]:
    params = [row_params(kind, i, vocab) for i in range(rows)]
    cols = list(zip(*params))
    return dict(temperature=torch.tensor(cols[0], dtype=torch.float32, device="cuda"),
                top_k=torch.tensor(cols[1], dtype=torch.int64, device="cuda"),
                top_p=torch.tensor(cols[2], dtype=torch.float32, device="cuda"),
                min_p=torch.tensor(cols[3], dtype=torch.float32, device="cuda"))


def make_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, device="cuda")
    logits *= torch.tensor([SCALES[i % len(SCALES)] for i in range(rows)], device="cuda")[:, None]
    if vocab > 10:
        logits[:, 3] = float("-inf")  # a token masked by a penalty / min_tokens
    return logits


def reference(logits, p, noise) -> torch.Tensor:
    """sample_ref in float64 on copies."""
    return sample_ref(logits.double(), p["temperature"].double(), p["top_k"],
                      p["top_p"].double(), p["min_p"].double(), noise.double())


def run_kernel(kernels, logits, p, seed=None, offset=None, noise=None) -> torch.Tensor:
    from tinyvllm.ops.sampling_cuda import sample_cuda
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device="cuda")  # poison
    before = logits.clone()
    got = sample_cuda(kernels, logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"],
                      seed, offset, noise, out=out)
    assert got is out
    assert torch.equal(logits, before), "the kernel must not modify the logits"
    assert (out >= 0).all() and (out < logits.shape[1]).all(), "unwritten or out-of-range token"
    return out


# ------------------------------------------------------------------ exact, with a noise tensor


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", ROWS)
def test_same_tokens_as_reference_given_the_noise(kernels, rows, vocab, kind):
    logits = make_logits(rows, vocab, seed=rows * 1000 + vocab)
    p = batch_params(kind, rows, vocab)
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    noise = torch.empty(rows, vocab, device="cuda").exponential_(generator=gen)
    got = run_kernel(kernels, logits, p, noise=noise)
    assert got.tolist() == reference(logits, p, noise).tolist()


@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_ties_take_the_lowest_index(kernels, vocab):
    logits = make_logits(3, vocab, seed=1)
    tied = sorted({vocab - 1, vocab // 2, min(1, vocab - 1)}, reverse=True)
    logits[:, tied] = 1.0e4  # spread over the CTAs that share a row
    p = batch_params("greedy", 3, vocab)
    got = run_kernel(kernels, logits, p, seed=torch.zeros(3, dtype=torch.int64, device="cuda"),
                     offset=torch.zeros(3, dtype=torch.int64, device="cuda"))
    assert got.tolist() == [min(tied)] * 3 == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [7, 1000, 49152, 128256])
@pytest.mark.parametrize("rows", [1, 3, 37, 300])
def test_argmax_is_torch_argmax_with_ties_infinities_and_nan(rows, vocab):
    """ops.sampling.argmax (the kernel's greedy path, rows split over CTAs) against torch.argmax:
    ties to the lowest index, -inf, and NaN above every number with the first NaN winning."""
    from tinyvllm.ops.sampling import argmax
    logits = make_logits(rows, vocab, seed=rows + vocab)
    last = vocab - 1
    for i in range(rows):
        kind = i % 6
        if kind == 1:    # a tie spread over the row
            logits[i, [last, vocab // 2, min(1, last)]] = 1.0e4
        elif kind == 2:  # NaN late in the row beats a +inf early
            logits[i, 0] = float("inf")
            logits[i, last] = float("nan")
        elif kind == 3:  # several NaN: the first
            logits[i, [last, vocab // 2, vocab // 3]] = float("nan")
        elif kind == 4:
            logits[i] = float("nan")
        elif kind == 5:
            logits[i] = float("-inf")
    got = argmax(logits)
    assert got.dtype == torch.int64 and got.tolist() == logits.argmax(-1).tolist()


def test_a_sampled_row_of_nan_gives_token_0_as_the_reference(kernels):
    """The race skips NaN, so an all-NaN row has no candidate: token 0, the reference's (its
    softmax is NaN throughout, and torch.argmax takes the first NaN)."""
    from tinyvllm.ops.sampling_cuda import sample_cuda
    logits = make_logits(3, 1000, seed=5)
    logits[1] = float("nan")
    p = batch_params("temperature", 3, 1000)
    noise = torch.empty(3, 1000, device="cuda").exponential_(
        generator=torch.Generator(device="cuda").manual_seed(0))
    out = torch.full((3,), -1, dtype=torch.int64, device="cuda")
    sample_cuda(kernels, logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], None, None,
                noise, out=out)
    assert out[1].item() == 0 and (out >= 0).all() and (out < 1000).all()
    assert reference(logits, p, noise)[1].item() == 0


# ------------------------------------------------------------------ Philox


def philox_inputs(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    seeds = [int(x) for x in torch.randint(0, 1 << 62, (rows,), generator=gen)]
    seeds = [s * 4 + 3 for s in seeds]  # some above 2^63: the kernel reads them as unsigned
    offsets = [int(x) * (1 << 31) + i for i, x in enumerate(torch.randint(0, 8, (rows,),
                                                                          generator=gen))]
    return seeds, offsets


def as_device(values: list[int]) -> torch.Tensor:
    return torch.tensor([as_int64(v) for v in values], dtype=torch.int64, device="cuda")


@pytest.mark.parametrize("kind", ["temperature", "top_p", "combined", "mixed"])
@pytest.mark.parametrize("vocab", [1000, 32001, 128256])
@pytest.mark.parametrize("rows", [3, 37])
def test_philox_noise_matches_its_host_copy(kernels, rows, vocab, kind):
    logits = make_logits(rows, vocab, seed=vocab + rows)
    p = batch_params(kind, rows, vocab)
    seeds, offsets = philox_inputs(rows, seed=rows + vocab)
    noise = torch.stack([philox_exponential(s, o, vocab) for s, o in zip(seeds, offsets)])
    got = run_kernel(kernels, logits, p, seed=as_device(seeds), offset=as_device(offsets))
    assert got.tolist() == reference(logits, p, noise.cuda()).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_philox_token_survives_the_reference_filters(kernels, kind):
    rows, vocab = 64, 32001
    logits = make_logits(rows, vocab, seed=5)
    p = batch_params(kind, rows, vocab)
    survivors = logits.double()
    apply_filters(survivors, p["temperature"].double(), p["top_k"], p["top_p"].double(),
                  p["min_p"].double())
    greedy = p["temperature"] <= 0
    for step in range(4):
        seeds, offsets = philox_inputs(rows, seed=step)
        got = run_kernel(kernels, logits, p, seed=as_device(seeds), offset=as_device(offsets))
        picked = survivors.gather(1, got[:, None]).squeeze(1)
        assert torch.isfinite(picked[~greedy]).all()
        assert torch.equal(got[greedy], logits.argmax(-1)[greedy])


@pytest.mark.parametrize("kind", ["temperature", "combined", "top_p", "min_p", "greedy"])
def test_seeded_token_does_not_depend_on_the_batch(kernels, kind):
    vocab = 128256
    target = make_logits(1, vocab, seed=7)[0]
    tp = row_params(kind, 1, vocab)
    for trial in range(4):
        seed, offset = 1234567 + trial, 17 * trial
        tokens = []
        for rows, position in [(1, 0), (8, 5), (64, 0), (64, 63), (300, 150)]:
            logits = make_logits(rows, vocab, seed=100 + rows + trial)
            logits[position] = target
            p = batch_params("mixed", rows, vocab)
            for name, value in zip(("temperature", "top_k", "top_p", "min_p"), tp):
                p[name][position] = value
            seeds, offsets = philox_inputs(rows, seed=rows + trial)
            seeds[position], offsets[position] = seed, offset
            got = run_kernel(kernels, logits, p, seed=as_device(seeds), offset=as_device(offsets))
            tokens.append(got[position].item())
        assert len(set(tokens)) == 1, tokens


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(stat), int(keep.sum()) - 1


SMALL_ROW = [1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2]
NUM_DRAWS = 40_000


@pytest.mark.parametrize("params", [
    (0.7, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.3),
    (0.9, 5, 0.8, 0.1),
], ids=["temperature", "top_k", "top_p", "min_p", "combined"])
def test_frequencies_match_the_reference_probabilities(kernels, params):
    vocab = len(SMALL_ROW)
    logits = torch.tensor(SMALL_ROW, device="cuda").expand(NUM_DRAWS, -1)  # one row, stride 0
    p = {name: torch.full((NUM_DRAWS,), value, dtype=dtype, device="cuda")
         for name, value, dtype in zip(("temperature", "top_k", "top_p", "min_p"), params,
                                       (torch.float32, torch.int64, torch.float32, torch.float32))}
    seeds = torch.arange(NUM_DRAWS, dtype=torch.int64, device="cuda") * 7919 + 11
    offsets = torch.full((NUM_DRAWS,), 3, dtype=torch.int64, device="cuda")
    got = run_kernel(kernels, logits, p, seed=seeds, offset=offsets)
    counts = torch.bincount(got, minlength=vocab).double().cpu()
    filtered = logits[:1].double().clone()
    apply_filters(filtered, *(p[n][:1].double() if n != "top_k" else p[n][:1]
                              for n in ("temperature", "top_k", "top_p", "min_p")))
    stat, dof = chi_square(counts, filtered.softmax(-1)[0].cpu())
    assert stat < CHI2_CRIT[dof], (stat, dof, counts.tolist())


def test_frequencies_over_a_large_vocab_with_split_rows(kernels):
    """The single-pass race with up to 15 CTAs per row (16-row batches): Philox groups across CTA
    boundaries and the merge must still give the softmax frequencies."""
    vocab, rows, calls = 128256, 16, 2500
    hot = torch.tensor([5, 20000, 40001, 64000, 80003, 100000, 120000, 128255])
    row = torch.full((vocab,), -12.0)
    row[hot] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 1.8, 0.9])
    logits = row.cuda().expand(rows, -1)
    p = batch_params("temperature", rows, vocab)
    p["temperature"].fill_(1.0)
    counts = torch.zeros(vocab, dtype=torch.int64, device="cuda")
    offsets = torch.zeros(rows, dtype=torch.int64, device="cuda")
    for call in range(calls):
        seeds = torch.arange(rows, dtype=torch.int64, device="cuda") + call * rows
        counts += torch.bincount(run_kernel(kernels, logits, p, seed=seeds, offset=offsets),
                                 minlength=vocab)
    probs = row.double().softmax(-1)
    hot_counts = counts.cpu()[hot].double()
    binned = torch.cat([hot_counts, (counts.sum().cpu() - hot_counts.sum()).reshape(1)])
    binned_probs = torch.cat([probs[hot], (1 - probs[hot].sum()).reshape(1)])
    stat, dof = chi_square(binned, binned_probs)
    assert stat < CHI2_CRIT[dof], (stat, binned.tolist())


# ------------------------------------------------------------------ through the Sampler


def states(n: int, **params) -> list[SamplingState]:
    return [SamplingState.create(SamplingParams(**params), [1, 2], [], device="cuda")
            for _ in range(n)]


def test_sampler_on_cuda_filters_and_renormalises():
    probs = torch.tensor([0.05, 0.3, 0.02, 0.25, 0.03, 0.2, 0.1, 0.05])
    logits = probs.log().cuda().expand(NUM_DRAWS, -1).contiguous()
    ids = Sampler()(logits, states(NUM_DRAWS, top_k=4, top_p=0.75)).token_ids
    counts = torch.bincount(torch.tensor(ids), minlength=8).double()
    expected = torch.zeros(8, dtype=torch.float64)
    expected[[1, 3, 5]] = probs[[1, 3, 5]].double()
    stat, dof = chi_square(counts, expected / expected.sum())
    assert stat < CHI2_CRIT[dof]


def test_sampler_on_cuda_seeded_rows_ignore_the_batch_and_follow_the_output_length():
    logits = make_logits(1, 32001, seed=9)

    def draw(batch_rows: int, position: int, output: list[int]) -> int:
        batch = make_logits(batch_rows, 32001, seed=batch_rows).clone()
        batch[position] = logits[0]
        st = states(batch_rows, temperature=0.8, top_p=0.95)
        st[position] = SamplingState.create(SamplingParams(seed=42, temperature=1.0), [1], output,
                                            device="cuda")
        return Sampler()(batch, st).token_ids[position]

    for output in ([], [7], [7, 8, 9]):
        assert len({draw(1, 0, output), draw(5, 2, output), draw(40, 39, output)}) == 1
    assert len({draw(1, 0, [0] * n) for n in range(12)}) > 1  # the offset moves the draw


def test_sampler_on_cuda_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = make_logits(37, 49152, seed=3)
    st = [SamplingState.create(SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=40),
                               [1], [], device="cuda") for i in range(37)]
    out = Sampler()(logits.clone(), st).token_ids
    assert out[1::2] == logits.argmax(-1).tolist()[1::2]


# ------------------------------------------------------------------ validation


def test_bad_inputs_raise_naming_the_parameter(kernels):
    from tinyvllm.ops.sampling_cuda import sample_cuda
    logits = make_logits(2, 100, seed=0)
    p = batch_params("temperature", 2, 100)
    seed = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="^logits"):
        sample_cuda(kernels, logits.half(), p["temperature"], None, None, None, seed, seed, None)
    with pytest.raises(ValueError, match="^seed"):
        sample_cuda(kernels, logits, p["temperature"], None, None, None, None, None, None)
    with pytest.raises(ValueError, match="^top_k"):
        sample_cuda(kernels, logits, p["temperature"], p["top_k"].int(), None, None, seed, seed,
                    None)
    with pytest.raises(ValueError, match="^noise"):
        sample_cuda(kernels, logits, p["temperature"], None, None, None, None, None,
                    torch.ones(2, 99, device="cuda"))
