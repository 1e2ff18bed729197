"""`tinyvllm bench ...`: the commands parse, and a tiny latency run writes a well-formed record."""

from __future__ import annotations

import json

import pytest

from tinyvllm.entrypoints.cli import build_parser, main

RECORD_KEYS = {"benchmark", "git_rev", "device", "torch", "cuda", "model", "dtype",
               "quantization", "engine_config", "workload", "results"}


def test_every_benchmark_is_a_subcommand():
    parser = build_parser()
    for name in ("latency", "throughput", "prefix", "spec"):
        args = parser.parse_args(["bench", name, "--no-baseline", "--max-num-seqs", "4"])
        assert args.benchmark == name and args.baseline is False and args.max_num_seqs == 4


def test_kernels_and_serve_get_the_rest_of_the_command_line():
    args = build_parser().parse_args(["bench", "kernels", "--quick", "--out", "k.json"])
    assert args.rest == ["--quick", "--out", "k.json"]


@pytest.mark.slow
def test_latency_writes_a_record(tmp_path, smollm2_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--max-tokens", "4", "--input-len", "8", "--num-iters", "2",
                 "--no-baseline", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert RECORD_KEYS <= record.keys()
    assert record["benchmark"] == "latency"
    assert record["workload"]["input_len"] == 8 and record["workload"]["output_len"] == 4
    assert record["engine_config"]["cache"]["enable_prefix_caching"] is True
    ours = record["results"]["tinyvllm"]
    assert ours["tpot"]["count"] == 2 * 3  # 4 tokens -> 3 gaps per request, 2 requests
    assert ours["ttft"]["median_ms"] > 0 and ours["decode_tokens_per_s"] > 0
    assert "baseline" not in record
    assert "TPOT ms" in capsys.readouterr().out  # the table is printed


@pytest.mark.slow
def test_spec_writes_a_record(tmp_path, smollm2_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--max-tokens", "6", "--batch-sizes", "1", "--workloads",
                 "repetitive", "--no-baseline", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert RECORD_KEYS <= record.keys() and record["benchmark"] == "spec"
    (result,) = record["results"]
    assert result["workload"] == "repetitive" and result["batch_size"] == 1
    assert result["identical_outputs"] is True
    assert result["off"]["num_output_tokens"] == result["on"]["num_output_tokens"] == 6
    assert result["off"]["num_drafts"] == 0 and result["on"]["num_drafts"] > 0
    assert record["workload"]["speculative_config"]["method"] == "ngram"
    assert "accept rate" in capsys.readouterr().out
