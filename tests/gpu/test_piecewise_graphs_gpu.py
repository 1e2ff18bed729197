"""Piecewise CUDA graphs on CUDA (`worker/cuda_graph.PiecewiseGraphs`): steps the decode graphs do
not serve (prompt chunks, chunks mixed with decodes, decodes past the captured context tiers)
replay everything but the attention from graphs captured per token-count bucket.

A small random model in bf16 (head_dim 64, block size 16). Each such step's logits are compared
with the eager forward of the same step (run right after, over the same cache); the graphs' GEMMs
see the bucket's row count, so the two agree to bf16 rounding, not in every bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import small_cuda_model
from tests.engine.conftest import assert_all_blocks_free, run_to_completion
from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import UniProcExecutor
from tinyvllm.model.loader import LoadedModel
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker import cuda_graph
from tinyvllm.worker.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def small() -> LoadedModel:
    return small_cuda_model(seed=7)


def make_core(small, **kwargs) -> EngineCore:
    kwargs.setdefault("max_piecewise_graph_tokens", 512)
    config = EngineConfig.from_kwargs(device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                      **kwargs)
    return EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=small)))


def check_against_eager(core: EngineCore) -> list[int]:
    """Wrap the runner's forward: every step the piecewise graphs run is run again eagerly and
    its sampled rows' logits compared. Returns the token counts of those steps."""
    runner = core.runner
    forward = runner._forward
    steps = []

    def checked(inputs):
        logits, rows = forward(inputs)
        if inputs.graph is None and runner.piecewise.pick(inputs.num_tokens) is not None:
            steps.append(inputs.num_tokens)
            n = inputs.num_tokens
            b = runner.buffers
            hidden = runner.model(b.input_ids_device(n), b.positions_device(n),
                                  runner.kv_caches, inputs.meta)
            assert torch.allclose(rows[:n].float(), hidden.float(), atol=5e-2, rtol=5e-2)
            if logits is not None:
                eager = runner.model.compute_logits(hidden[inputs.logits_indices])
                assert torch.allclose(logits, eager, atol=5e-2, rtol=5e-2)
        return logits, rows

    runner._forward = checked
    return steps


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_buckets_skip_the_fused_sizes_and_stop_at_the_limit(small):
    core = make_core(small, max_num_seqs=8, max_piecewise_graph_tokens=200)
    pw = core.runner.piecewise
    assert pw.sizes[-1] == 200 and pw.sizes == cuda_graph.piecewise_token_sizes(200)
    captured = sorted(pw.graphs)
    assert captured and captured[-1] == 200
    assert all(not pw.fused(t) for t in captured)
    assert all(len(g) == len(small.model.model.layers) + 1 for g in pw.graphs.values())
    assert pw.pick(201) is None
    assert pw.pick(1) is None  # a decode-sized step: the fused layers, eagerly
    core.shutdown()


def test_prompt_and_mixed_steps_match_eager(small):
    """Prompts arriving while others decode, in chunks of at most 96 tokens: prompt-only steps,
    chunks mixed with decodes, steps of every size up to the budget; a later, smaller step's
    padding rows hold a larger one's values."""
    core = make_core(small, max_num_seqs=8, max_num_batched_tokens=96)
    steps = check_against_eager(core)
    first = prompts([70, 33, 90, 41])
    outputs = run_to_completion(core, first, [greedy(n) for n in (12, 30, 7, 20)])
    assert [len(o) for o in outputs] == [12, 30, 7, 20]
    # Prompts of 150 and 200 tokens are chunked (96 a step) beside the decodes of the rest.
    second = prompts([150, 200, 19, 5], seed=1)
    outputs = run_to_completion(core, second, [greedy(n) for n in (9, 4, 25, 16)])
    assert [len(o) for o in outputs] == [9, 4, 25, 16]
    assert_all_blocks_free(core)
    assert len(steps) >= 4 and max(steps) == 96 and len(set(steps)) >= 3
    core.shutdown()


def test_greedy_tokens_equal_without_piecewise_graphs(small):
    """The same prompts with mixed steps eager (--max-piecewise-graph-tokens 0): the first tokens
    agree (later ones may part at a bf16 near-tie: the GEMMs' row counts differ)."""
    batch = prompts([64, 40, 100, 23, 57])
    lengths = [10, 6, 8, 12, 5]
    eager = make_core(small, max_num_seqs=8, max_piecewise_graph_tokens=0)
    assert eager.runner.piecewise is None
    expected = run_to_completion(eager, batch, [greedy(n) for n in lengths])
    eager.shutdown()
    core = make_core(small, max_num_seqs=8)
    steps = check_against_eager(core)
    got = run_to_completion(core, batch, [greedy(n) for n in lengths])
    assert_all_blocks_free(core)
    core.shutdown()
    assert steps
    assert [o[:3] for o in got] == [e[:3] for e in expected]


def test_decodes_past_the_context_tiers_replay_pieces(small, monkeypatch):
    """Decodes whose contexts outgrow the decode graphs' tiers, too many rows for the fused
    layers, run piecewise."""
    monkeypatch.setattr(cuda_graph, "MAX_SEQ_LEN_TO_CAPTURE", 32)
    monkeypatch.setattr(cuda_graph, "SEQ_LEN_TIERS", ())
    core = make_core(small, max_num_seqs=24)
    assert core.runner.graphs.seq_len_tiers == [32]
    steps = check_against_eager(core)
    outputs = run_to_completion(core, prompts([40] * 20), [greedy(6)] * 20)
    assert [len(o) for o in outputs] == [6] * 20
    assert_all_blocks_free(core)
    core.shutdown()
    assert 20 in steps  # the decode steps of 20 rows
