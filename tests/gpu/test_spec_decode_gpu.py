"""Speculative decoding on a CUDA device with the real SmolLM2-135M (bf16, graphs captured):
verification steps replay the verification graphs (decodes and verifications as decode rows),
a truncated self-draft's steps replay the draft graphs, and nothing leaks.

Outputs with speculation on and off are compared over their first tokens only: a plain decode at
batch 1 runs the scalar GEMV projections and the decode kernel with the new token fused in, a
verification the tensor-core GEMV and a separate rotary launch, whose bf16 roundings may part at a
near-tie later on (the CPU tests show exact equality, tests/engine); with `batch_invariant` every
token of every step (decode, verification, prefill chunk, recomputation after preemption) takes
the same kernels, and the whole outputs are compared.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_gpu import (engine, generate, path, prompts,  # noqa: F401
                                              release)
from tinyvllm.worker.cuda_graph import DecodeGraphs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
FIRST_TOKENS = 8
# Repetitive: a counting pattern and a list the model continues by repeating.
REPETITIVE = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,",
              "red green blue red green blue red green blue red"]


@pytest.fixture
def replays(monkeypatch) -> dict[str, int]:
    """Graph replays counted by the name of their set (decode, verification, draft)."""
    counts: dict[str, int] = {}
    replay = DecodeGraphs.replay

    def counted(self, key):
        counts[self.name] = counts.get(self.name, 0) + 1
        return replay(self, key)

    monkeypatch.setattr(DecodeGraphs, "replay", counted)
    return counts


def encode(path, texts: list[str]) -> list[list[int]]:
    from tinyvllm.tokenization import load_tokenizer
    tok = load_tokenizer(str(path))
    return [tok.encode(t) for t in texts]


def test_ngram_verification_replays_graphs(path, prompts, replays):
    batch = encode(path, REPETITIVE) + prompts[:2]
    lengths = [48, 40, 24, 32]
    plain = engine(path, dtype="bfloat16")
    assert plain.runner.verify_graphs is None
    expected = generate(plain, batch, lengths)
    release(plain)

    spec = engine(path, dtype="bfloat16", speculative_config=NGRAM)
    assert spec.runner.verify_graphs is not None
    replays.clear()
    outputs = generate(spec, batch, lengths)  # asserts every block is free
    stats = spec.get_stats()
    release(spec)
    assert [len(o) for o in outputs] == lengths
    assert replays.get("verification", 0) > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert [o[:FIRST_TOKENS] for o in outputs] == [e[:FIRST_TOKENS] for e in expected]


def test_self_draft_steps_replay_graphs(path, prompts, replays):
    """A full-depth self-draft drafts with the decode kernels and is verified with them: it
    accepts (nearly) everything."""
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "draft_num_layers": 30}
    core = engine(path, dtype="bfloat16", speculative_config=spec)
    try:
        assert core.runner.drafter.graphs is not None
        replays.clear()
        outputs = generate(core, prompts[:3], [24, 24, 16])
        assert [len(o) for o in outputs] == [24, 24, 16]
        assert replays.get("draft", 0) > 0 and replays.get("verification", 0) > 0
        stats = core.get_stats()
        assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0
    finally:
        release(core)


@pytest.mark.parametrize("batch,k", [(1, 7), (2, 7), (4, 3)])
def test_batch_invariant_outputs_equal_with_speculation_on_and_off(path, prompts, replays, batch,
                                                                   k):
    """`--batch-invariant`: a decode row and a verified row take the same kernels (the
    tensor-core GEMV, rotary and cache write before the decode attention, partitions by context
    only), so greedy output is the same token for token with speculation on and off."""
    texts = (encode(path, REPETITIVE) + prompts[:2])[:batch]
    lengths = [64, 48, 40, 32][:batch]
    plain = engine(path, dtype="bfloat16", batch_invariant=True)
    expected = generate(plain, texts, lengths)
    release(plain)

    config = {**NGRAM, "num_speculative_tokens": k}
    spec = engine(path, dtype="bfloat16", speculative_config=config, batch_invariant=True)
    replays.clear()
    outputs = generate(spec, texts, lengths)  # asserts every block is free
    stats = spec.get_stats()
    release(spec)
    assert replays.get("verification", 0) > 0
    assert stats.spec_num_accepted_tokens > 0
    assert outputs == expected


INVARIANT_BATCH_TOKENS = [64, 56, 48, 40, 64, 48, 32, 56]
INVARIANT_ENGINES = {
    # Up to 8 requests x 8 rows a step: verification graphs of more rows than one GEMV launch.
    "batched": {},
    # Prompts chunked beside verifications in one step's budget (mixed steps, run eagerly).
    "mixed_chunked": {"max_num_batched_tokens": 32},
    # Too few blocks for all: preempted requests recompute their tokens as prefill rows.
    "preempting": {"num_kv_blocks": 12, "block_size": 16},
}
PROPOSERS = {"ngram": {**NGRAM, "num_speculative_tokens": 7},
             "self_draft": {"method": "draft_model", "num_speculative_tokens": 4,
                            "draft_num_layers": 10}}


@pytest.fixture(scope="module")
def invariant_texts(path, prompts) -> list[list[int]]:
    return encode(path, REPETITIVE) + prompts


@pytest.fixture(scope="module")
def invariant_off(path, invariant_texts) -> list[list[int]]:
    """Speculation off, batch-invariant, the default step budget (prompts whole)."""
    plain = engine(path, dtype="bfloat16", batch_invariant=True)
    try:
        return generate(plain, invariant_texts, INVARIANT_BATCH_TOKENS)
    finally:
        release(plain)


def spy_steps(core) -> dict[str, int]:
    """Count scheduled steps with verifications, and those that also hold a prefill chunk."""
    counts = {"verifying": 0, "mixed": 0, "preempted": 0}
    schedule = core.scheduler.schedule

    def spied():
        out = schedule()
        verifying = any(s.draft_token_ids for s in out.scheduled)
        prefill = any(s.num_new_tokens > 1 + len(s.draft_token_ids) for s in out.scheduled)
        counts["verifying"] += verifying
        counts["mixed"] += verifying and prefill
        counts["preempted"] += len(out.preempted_request_ids)
        return out

    core.scheduler.schedule = spied
    return counts


@pytest.mark.parametrize("proposer", PROPOSERS.values(), ids=PROPOSERS.keys())
@pytest.mark.parametrize("engine_kwargs", INVARIANT_ENGINES.values(),
                         ids=INVARIANT_ENGINES.keys())
def test_batch_invariant_identical_in_mixed_steps_and_under_preemption(
        path, invariant_texts, invariant_off, engine_kwargs, proposer):
    """`--batch-invariant` makes every token's logits a function of its own context: decode,
    verification and prefill rows take the same kernels (the GEMV in chunks of 16 rows), so
    greedy output with speculation on equals it off whatever the steps hold: 8 requests of 8
    rows, prompts chunked beside verifications, recomputation after preemption, prefix-cache
    hits (on by default), with either proposer."""
    spec = engine(path, dtype="bfloat16", speculative_config=proposer, batch_invariant=True,
                  **engine_kwargs)
    counts = spy_steps(spec)
    try:
        outputs = generate(spec, invariant_texts, INVARIANT_BATCH_TOKENS)  # no block leaked
        stats = spec.get_stats()
    finally:
        release(spec)
    assert outputs == invariant_off
    assert stats.spec_num_accepted_tokens > 0 and counts["verifying"] > 0
    if "max_num_batched_tokens" in engine_kwargs:
        assert counts["mixed"] > 0
    if "num_kv_blocks" in engine_kwargs:
        assert counts["preempted"] > 0


def test_batch_invariant_logits_do_not_depend_on_the_step(path, invariant_texts):
    """Under `--batch-invariant` a position's logprobs are the same bits whether it runs as a
    prefill row of a whole prompt, of chunks of 5 beside other requests, or after a prefix-cache
    hit, or as a decode row in batches of any size."""
    from tests.engine.conftest import run_to_completion
    from tinyvllm.sampling_params import SamplingParams

    prompt, others = invariant_texts[1], invariant_texts[2:6]

    def run(core, batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5,
                                ignore_eos=True)
        return run_to_completion(core, batch, params, field="new_logprobs")[0]

    whole = engine(path, dtype="bfloat16", batch_invariant=True)
    try:
        expected = run(whole, [prompt], 16)  # one prefill row, then decode rows at batch 1
    finally:
        release(whole)
    tokens = [lp.token_id for lp in expected]
    chunked = engine(path, dtype="bfloat16", batch_invariant=True, max_num_batched_tokens=5)
    try:
        assert run(chunked, [prompt] + others, 16) == expected
        # Its first 8 outputs as prompt: prefill rows now (full blocks from the cache).
        assert run(chunked, [prompt + tokens[:8]] + others, 8) == expected[8:]
    finally:
        release(chunked)


@pytest.mark.parametrize("kwargs,error", [
    ({"quantization": "gptq"}, "projections do not all run the tensor-core GEMV"),  # W4A16 tiles
    ({"quantization": "fp8"}, "projections do not all run the tensor-core GEMV"),  # cuBLAS FP8
    ({"dtype": "float32"}, r"needs dtype bfloat16 or float16 \(.*\), got torch.float32"),
])
def test_batch_invariant_refuses_what_it_cannot_cover(kwargs, error):
    """A model whose projections the tensor-core GEMV does not take would still give
    batch-dependent outputs: refused at start, naming why (random-weight SmolLM2 shape)."""
    from tinyvllm.config import EngineConfig
    from tinyvllm.worker.model_runner import ModelRunner

    kwargs = {"dtype": "bfloat16", **kwargs}
    config = EngineConfig.from_kwargs(model="smollm2-135m-shape", device="cuda",
                                      batch_invariant=True, max_model_len=512, **kwargs)
    with pytest.raises(ValueError, match=error):
        ModelRunner(config)
