"""Async scheduling on CUDA: graph replays and eager steps read decode inputs filled on the device
from the step in flight; the tokens equal the synchronous engine's and no block leaks.

A small random model in bf16 (head_dim 64, block size 16: the kernels' shapes). Every request
ignores EOS, so that both engines run the same batches step for step (a request ruled out by
max_tokens is not scheduled ahead) and the same kernels see the same shapes.
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
from tinyvllm.worker.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_TOKENS = [40, 8, 24, 33, 16, 48]


@pytest.fixture(scope="module")
def small() -> LoadedModel:
    return small_cuda_model(seed=5)


def run(small, async_scheduling: bool, **kwargs) -> tuple[list[list[int]], int]:
    """Greedy outputs of every prompt at once, and the number of device-side input fills."""
    config = EngineConfig.from_kwargs(device="cuda", dtype="bfloat16", num_kv_blocks=256,
                                      max_num_seqs=8, async_scheduling=async_scheduling,
                                      **kwargs)
    core = EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=small)))
    fills = [0]
    fill = core.runner.buffers.fill_prev_token_ids

    def counted(*args):
        fills[0] += 1
        return fill(*args)

    core.runner.buffers.fill_prev_token_ids = counted
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (5 + 7 * i,), generator=g).tolist()
               for i in range(len(MAX_TOKENS))]
    outputs = run_to_completion(core, prompts, [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    assert_all_blocks_free(core)
    core.shutdown()
    return outputs, fills[0]


@pytest.mark.parametrize("kwargs", [{}, {"enforce_eager": True},
                                    {"max_num_batched_tokens": 32}])
def test_async_equals_sync_on_cuda(small, kwargs):
    expected, sync_fills = run(small, False, **kwargs)
    got, async_fills = run(small, True, **kwargs)
    assert [len(t) for t in got] == MAX_TOKENS
    assert got == expected
    assert sync_fills == 0 and async_fills > max(MAX_TOKENS) // 2
