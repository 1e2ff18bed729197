"""Draft-model speculation on a CUDA device (bf16, decode graphs captured): a full-depth
self-draft and a draft checkpoint equal to the target run to completion with no KV block leaked
and nearly every draft accepted (not every one: the draft steps take the decode kernels and the
verification the prefill kernels, which may part after bf16 near-ties)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_model_runner_gpu import (engine, generate, path, prompts,  # noqa: F401
                                              release)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MIN_ACCEPTANCE = 0.9


@pytest.mark.parametrize("draft", ["draft_num_layers", "model"])
def test_draft_equal_to_the_target_accepts_nearly_everything(path, prompts, draft):
    spec = {"method": "draft_model", "num_speculative_tokens": 4}
    spec.update({"model": str(path)} if draft == "model" else {"draft_num_layers": 30})
    core = engine(path, dtype="bfloat16", speculative_config=spec)
    try:
        assert core.runner.arch.num_layers == 30  # SmolLM2-135M
        outputs = generate(core, prompts[:2], [24, 24])
        assert [len(o) for o in outputs] == [24, 24]
        stats = core.get_stats()
        assert stats.spec_num_draft_tokens > 0
        assert stats.spec_num_accepted_tokens >= MIN_ACCEPTANCE * stats.spec_num_draft_tokens
    finally:
        release(core)
