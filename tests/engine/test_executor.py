"""Executors: worker processes driven by SchedulerOutput messages give the engine the same tokens
as the in-process runner; a worker that dies takes the engine down with an error naming it."""

from __future__ import annotations

import os
import signal

import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import MultiprocExecutor, UniProcExecutor
from tinyvllm.sampling_params import SamplingParams

from tests.engine.conftest import assert_all_blocks_free, run_to_completion

PROMPTS = [[1, 504, 3458, 314, 253, 1837], [1, 28, 1115, 281, 3705, 28, 1115, 281], [9, 8, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)


def _config(model_path, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model_path), device="cpu", dtype="float32",
                                    max_model_len=256, num_kv_blocks=48, block_size=16,
                                    max_num_batched_tokens=16, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_worker_process_gives_the_in_process_tokens(smollm2_path, async_scheduling):
    """Chunked prefill (16-token budget), greedy and seeded rows in one batch, with and without
    a step scheduled ahead of the one in flight."""
    params = [GREEDY, SEEDED, GREEDY]
    uni = EngineCore(_config(smollm2_path, async_scheduling=async_scheduling))
    expected = run_to_completion(uni, PROMPTS, params)
    uni.shutdown()
    engine = EngineCore(_config(smollm2_path, async_scheduling=async_scheduling,
                                distributed_executor_backend="mp"))
    try:
        assert isinstance(engine.executor, MultiprocExecutor)
        assert run_to_completion(engine, PROMPTS, params) == expected
        assert run_to_completion(engine, PROMPTS[:1], GREEDY) == expected[:1]  # records reused
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.executor._procs)


def test_dead_worker_fails_the_step_naming_its_rank(smollm2_path):
    engine = EngineCore(_config(smollm2_path, distributed_executor_backend="mp"))
    try:
        run_to_completion(engine, PROMPTS[:1], GREEDY)
        os.kill(engine.executor._procs[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="worker rank 0 .* exited with code -9"):
            run_to_completion(engine, PROMPTS[:1], GREEDY)
    finally:
        engine.shutdown()


def test_in_process_is_the_default_for_one_rank(tiny_model):
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32")
    assert config.parallel.executor_backend == "uni"
    assert EngineConfig.from_kwargs(tensor_parallel_size=2).parallel.executor_backend == "mp"
    with pytest.raises(ValueError, match="uni runs one rank"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, distributed_executor_backend="uni")
    from tinyvllm.worker.model_runner import ModelRunner
    engine = EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=tiny_model)))
    assert engine.runtime_info.vocab_size == 512


# --- tensor parallelism: worker processes on gloo ----------------------------------------------

@pytest.fixture(scope="module")
def smollm2_dir(smollm2_model, tmp_path_factory) -> str:
    """SmolLM2-135M's weights as a safetensors checkpoint (9 query heads, 3 KV heads, tied):
    each rank reads only its slices (every rank parsing the GGUF would cost far more)."""
    from tinyvllm.model.synthetic import checkpoint_tensors
    from tests.model.test_tensor_parallel import _write_hf_dir

    model = smollm2_model.model
    tensors = {n: t for name, param in model.named_parameters()
               for n, t in checkpoint_tensors(name, param, model.arch)}
    return _write_hf_dir(tmp_path_factory.mktemp("smollm2-hf"), model.arch, tensors)


def _tp_config(path: str, size: int, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(model=path, device="cpu", dtype="float32", max_model_len=128,
                                    num_kv_blocks=40, block_size=16, max_num_batched_tokens=24,
                                    tensor_parallel_size=size, **kwargs)


def test_three_ranks_give_the_one_rank_tokens_on_smollm2(smollm2_dir):
    """Chunked prefill and a mixed greedy / seeded batch through three worker processes; the
    seeded row shows that every rank keeps rank 0's samples."""
    params = [GREEDY, SEEDED, GREEDY]
    one = EngineCore(_tp_config(smollm2_dir, 1))
    expected = run_to_completion(one, PROMPTS, params)
    one.shutdown()
    engine = EngineCore(_tp_config(smollm2_dir, 3))
    try:
        assert run_to_completion(engine, PROMPTS, params) == expected
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_two_ranks_give_the_one_rank_tokens_on_a_synthetic_model(tmp_path):
    import torch

    from tinyvllm.model.synthetic import random_weights, tiny_arch
    from tests.model.test_tensor_parallel import _write_hf_dir

    arch = tiny_arch(vocab_size=509, num_heads=4, num_kv_heads=2, attention_bias=True)
    path = _write_hf_dir(tmp_path, arch, dict(random_weights(arch, 5, torch.float32,
                                                             torch.device("cpu"))))
    prompts = [[5, 17, 99, 3, 250, 8], [9, 8, 7, 6, 5, 4, 3, 2, 1, 400, 401, 402]]
    one = EngineCore(_tp_config(path, 1))
    expected = run_to_completion(one, prompts, GREEDY)
    one.shutdown()
    engine = EngineCore(_tp_config(path, 2, async_scheduling=True))
    try:
        assert run_to_completion(engine, prompts, GREEDY) == expected
    finally:
        engine.shutdown()


def test_a_size_that_does_not_split_the_heads_is_refused_at_start(smollm2_dir):
    with pytest.raises(RuntimeError, match="num_attention_heads 9 is not divisible"):
        EngineCore(_tp_config(smollm2_dir, 2))


def test_two_ranks_speculating_give_the_one_rank_tokens(tmp_path):
    """n-gram drafts verified on two ranks (rank 0's accepted tokens broadcast), beside a plain
    row, on repetitive prompts: the tokens of one rank without speculation."""
    import torch

    from tinyvllm.model.synthetic import random_weights, tiny_arch
    from tests.model.test_tensor_parallel import _write_hf_dir

    arch = tiny_arch(vocab_size=512, num_heads=4, num_kv_heads=2)
    path = _write_hf_dir(tmp_path, arch, dict(random_weights(arch, 5, torch.float32,
                                                             torch.device("cpu"))))
    prompts = [[7, 8, 9, 10] * 6, [5, 17, 99, 3, 250, 8] * 3]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)]
    one = EngineCore(_tp_config(path, 1))
    expected = run_to_completion(one, prompts, params)
    one.shutdown()
    engine = EngineCore(_tp_config(path, 2, speculative_config={"method": "ngram"}))
    try:
        assert run_to_completion(engine, prompts, params) == expected
        stats = engine.get_stats()
        assert stats.spec_num_drafts > 0  # the first row speculated; the second (logprobs) not
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
