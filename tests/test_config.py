"""Engine configuration at the edge: the KernelConfig section as CLI flags and LLM(...) kwargs."""

from __future__ import annotations

import argparse

import pytest

from tinyvllm.config import (EngineConfig, KernelConfig, add_engine_arguments,
                             engine_config_from_args)


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_kernel_flags_default_to_every_fusion():
    assert parse().kernel == KernelConfig() == KernelConfig(
        fused_gemv=True, gemv_max_rows=2, gemv_mma_max_rows=16, fused_rotary_cache=True,
        merge_in_o_proj=True,
        fused_act_quant=True, fp8_fast_accum=True, prefill_attention_kernel="auto",
        split_mixed_attention=True)


def test_kernel_flags_turn_fusions_off():
    config = parse("--no-fused-gemv", "--no-fused-rotary-cache", "--no-merge-in-o-proj",
                   "--gemv-max-rows", "1", "--gemv-mma-max-rows", "0", "--no-fused-act-quant",
                   "--no-fp8-fast-accum",
                   "--prefill-attention-kernel",
                   "mma_sync", "--no-split-mixed-attention")
    assert config.kernel == KernelConfig(fused_gemv=False, gemv_max_rows=1, gemv_mma_max_rows=0,
                                         fused_rotary_cache=False, merge_in_o_proj=False,
                                         fused_act_quant=False, fp8_fast_accum=False,
                                         prefill_attention_kernel="mma_sync",
                                         split_mixed_attention=False)
    assert config.model == parse().model  # the other sections are untouched


def test_gemv_max_rows_beyond_the_kernel_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("--gemv-max-rows", "3")
    assert "--gemv-max-rows: invalid choice: 3" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"gemv_max_rows must be in \[0, 2\]"):
        EngineConfig.from_kwargs(gemv_max_rows=-1)
    with pytest.raises(ValueError, match=r"gemv_mma_max_rows must be in \[0, 16\]"):
        EngineConfig.from_kwargs(gemv_mma_max_rows=17)


def test_unknown_prefill_attention_kernel_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("--prefill-attention-kernel", "wgmma")
    assert "invalid choice: 'wgmma'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prefill_attention_kernel must be auto or mma_sync"):
        EngineConfig.from_kwargs(prefill_attention_kernel="fa3")


def test_kernel_options_as_llm_kwargs():
    config = EngineConfig.from_kwargs(fused_rotary_cache=False, block_size=32)
    assert config.kernel == KernelConfig(fused_rotary_cache=False)
    assert config.cache.block_size == 32
    with pytest.raises(TypeError, match="unknown engine option 'fused_rotary'"):
        EngineConfig.from_kwargs(fused_rotary=False)


def test_step_sizes_chosen_for_the_device_unless_given():
    from tinyvllm.config import SchedulerConfig

    unset = SchedulerConfig()
    assert (unset.max_num_seqs, unset.max_num_batched_tokens) == (None, None)
    sizes = {(d, m): unset.for_device(d, m) for d, m in
             [("cpu", 0), ("cuda", 80), ("cuda", 24)]}
    assert [(c.max_num_seqs, c.max_num_batched_tokens) for c in sizes.values()] == [
        (256, 2048), (256, 8192), (256, 4096)]
    given = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)
    assert given.for_device("cuda", 80) == given
    with pytest.raises(ValueError, match="max_num_batched_tokens must be positive"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_piecewise_graph_tokens must be 0 or more"):
        EngineConfig.from_kwargs(max_piecewise_graph_tokens=-1)


def test_engine_schedules_with_the_runners_sizes(tiny_model):
    from tinyvllm.engine.engine_core import EngineCore
    from tinyvllm.engine.executor import UniProcExecutor
    from tinyvllm.worker.model_runner import ModelRunner

    config = EngineConfig.from_kwargs(device="cpu", dtype="float32")
    engine = EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=tiny_model)))
    assert engine.scheduler.config.max_num_batched_tokens == 2048 == engine.runner.max_num_tokens
    assert engine.config.scheduler.max_num_seqs == 256
