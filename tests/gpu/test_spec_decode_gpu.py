"""Speculative decoding on a CUDA device with the real SmolLM2-135M (bf16, graphs captured):
verification steps replay the verification graphs (decodes and verifications as decode rows),
a truncated self-draft's steps replay the draft graphs, and nothing leaks.

Outputs with speculation on and off are compared over their first tokens only: a plain decode at
batch 1 runs the scalar GEMV projections and the decode kernel with the new token fused in, a
verification the tensor-core GEMV and a separate rotary launch, whose bf16 roundings may part at a
near-tie later on (the CPU tests show exact equality, tests/engine); with `batch_invariant` both
take the same kernels, and the whole outputs are compared.
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
    only), so greedy output is the same token for token with speculation on and off wherever
    a step's rows fit the tensor-core GEMV (k + 1 rows per request, 16 in all)."""
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
