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
        fused_gemv=True, gemv_max_rows=2, fused_rotary_cache=True, merge_in_o_proj=True)


def test_kernel_flags_turn_fusions_off():
    config = parse("--no-fused-gemv", "--no-fused-rotary-cache", "--no-merge-in-o-proj",
                   "--gemv-max-rows", "1")
    assert config.kernel == KernelConfig(fused_gemv=False, gemv_max_rows=1,
                                         fused_rotary_cache=False, merge_in_o_proj=False)
    assert config.model == parse().model  # the other sections are untouched


def test_gemv_max_rows_beyond_the_kernel_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("--gemv-max-rows", "3")
    assert "--gemv-max-rows: invalid choice: 3" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"gemv_max_rows must be in \[1, 2\]"):
        EngineConfig.from_kwargs(gemv_max_rows=0)


def test_kernel_options_as_llm_kwargs():
    config = EngineConfig.from_kwargs(fused_rotary_cache=False, block_size=32)
    assert config.kernel == KernelConfig(fused_rotary_cache=False)
    assert config.cache.block_size == 32
    with pytest.raises(TypeError, match="unknown engine option 'fused_rotary'"):
        EngineConfig.from_kwargs(fused_rotary=False)
