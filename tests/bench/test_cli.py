"""`tinyvllm bench ...`: the commands parse, and a tiny latency run writes a well-formed record."""

from __future__ import annotations

import json
import sys

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
    args = build_parser().parse_args(["bench", "host", "--batch-sizes", "4"])
    assert args.rest == ["--batch-sizes", "4"]


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
    # On the CPU: packed weights, the --dequantize path beside them, a bandwidth floor.
    assert record["quantization"].startswith("GGUF Q4_1 blocks kept packed")
    assert record["quantization"].endswith("(CPU kernels)")
    deq = record["results"]["tinyvllm --dequantize"]
    assert deq["tpot"]["count"] == 2 * 3 and record["ratios_to"]["tinyvllm --dequantize"]
    bw = ours["bandwidth"]
    assert bw["copy_bandwidth_gbps"] > 0 and 0 < bw["weight_bytes"] < 100e6
    out = capsys.readouterr().out
    assert "TPOT ms" in out and "ours/tinyvllm --dequantize" in out  # the table is printed


@pytest.mark.slow
def test_runs_without_transformers(tmp_path, smollm2_path, monkeypatch, capsys):
    """After the Quick-start install (no transformers) the baseline is skipped with a notice.
    (latency, throughput and prefix share the runner that checks; the README test runs all.)"""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--max-tokens", "2", "--num-prompts", "2", "--input-len",
                 "8", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert "transformers" not in record["results"] and "baseline" not in record
    assert record["transformers"] is None
    err = capsys.readouterr().err
    assert "transformers is not installed: skipping the transformers baseline" in err


@pytest.mark.slow
def test_spec_writes_a_record(tmp_path, smollm2_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--max-tokens", "6", "--batch-sizes", "1", "--workloads",
                 "repetitive", "--no-baseline", "--rounds", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert RECORD_KEYS <= record.keys() and record["benchmark"] == "spec"
    (result,) = record["results"]
    assert len(result["rounds"]) == 2  # the table's round is one of them
    assert result["decode_tokens_per_s_ratio"] in [r["decode_tokens_per_s_ratio"]
                                                   for r in result["rounds"]]
    assert result["workload"] == "repetitive" and result["batch_size"] == 1
    assert result["identical_outputs"] is True
    assert result["off"]["num_output_tokens"] == result["on"]["num_output_tokens"] == 6
    assert result["off"]["num_drafts"] == 0 and result["on"]["num_drafts"] > 0
    # Steps after the first token: 5 one-token steps off, fewer than 5 with drafts accepted.
    assert result["off"]["decode_steps"] == 5
    assert 0 < result["on"]["decode_steps"] <= 5 and result["step_cost_ratio"] > 0
    # Every decode step is counted under one kind; the verified ones yield drafts' tokens too.
    for run in ("off", "on"):
        kinds = result[run]["steps"]
        assert sum(kind["steps"] for kind in kinds.values()) == result[run]["decode_steps"]
    assert result["off"]["steps"]["verified"]["steps"] == 0
    verified = result["on"]["steps"]["verified"]
    assert verified["steps"] > 0 and verified["tokens_per_step"] > 1
    assert record["workload"]["speculative_config"]["method"] == "ngram"
    printed = capsys.readouterr().out
    assert "step ms on" in printed and "decode steps by kind" in printed


def test_spec_step_kinds():
    """A decode step that emitted nothing had its work dropped (behind a verification that
    fell short); the others are named by what they did."""
    import types

    from tinyvllm.bench.spec import STEP_KINDS, _step_kind

    ahead, idle = (types.SimpleNamespace(has_step_in_flight=v) for v in (True, False))
    assert [_step_kind(ahead, True, 5), _step_kind(ahead, False, 1), _step_kind(idle, False, 1),
            _step_kind(ahead, False, 0)] == list(STEP_KINDS)


def test_spec_reports_the_median_round():
    from tinyvllm.bench.spec import median_round

    def round_(ratio, identical=True):
        return {"decode_tokens_per_s_ratio": ratio, "output_tokens_per_s_ratio": ratio / 2,
                "identical_outputs": identical, "on": {"tag": ratio}}

    picked = median_round([round_(1.3), round_(0.8), round_(1.1, identical=False)])
    assert picked["on"] == {"tag": 1.1} and picked["decode_tokens_per_s_ratio"] == 1.1
    assert picked["identical_outputs"] is False  # any round that differs counts
    assert [r["decode_tokens_per_s_ratio"] for r in picked["rounds"]] == [1.3, 0.8, 1.1]
    # An even count takes the lower middle.
    assert median_round([round_(2.0), round_(1.0)])["decode_tokens_per_s_ratio"] == 1.0


@pytest.mark.slow
def test_spec_with_a_truncated_self_draft(tmp_path, smollm2_path):
    out = tmp_path / "spec.json"
    spec = '{"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 30}'
    assert main(["bench", "spec", "--max-tokens", "6", "--batch-sizes", "1", "--workloads",
                 "open", "--no-baseline", "--rounds", "1", "--speculative-config", spec,
                 "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["identical_outputs"] is True
    # The full-depth self-draft is the target: every draft token is accepted.
    assert result["off"]["num_drafts"] == 0 and result["on"]["num_drafts"] > 0
    assert result["on"]["acceptance_rate"] == 1.0


def test_spec_runs_start_with_an_empty_prefix_cache():
    """bench spec's two engines share one KV cache's memory, each with its own block pool: a
    block one engine's prefix cache names may hold the other's tokens, so every run resets it
    (and refuses to run on a cache it cannot reset)."""
    import types

    from tinyvllm.bench import spec

    class Engine:
        has_step_in_flight = False
        scheduler = types.SimpleNamespace(spec=types.SimpleNamespace(
            stats=types.SimpleNamespace(num_drafts=0)))

        def __init__(self, resettable):
            self.resettable, self.resets = resettable, 0

        def reset_prefix_cache(self):
            self.resets += 1
            return self.resettable

        def get_stats(self):
            return types.SimpleNamespace(spec_num_drafts=0, spec_num_draft_tokens=0,
                                         spec_num_accepted_tokens=0)

        def add_request(self, request):
            self.pending = [types.SimpleNamespace(request_id=request.request_id,
                                                  new_token_ids=[5])]

        def has_unfinished_requests(self):
            return bool(self.pending)

        def step(self):
            out, self.pending = self.pending, []
            return out

    engine = Engine(True)
    assert spec.run_once(engine, [[1, 2, 3]], 1, lambda: None)["tokens"] == [[5]]
    assert engine.resets == 1
    with pytest.raises(RuntimeError, match="prefix cache could not be reset"):
        spec.run_once(Engine(False), [], 4, lambda: None)


def test_weights_format_names_the_kernels_that_read_packed_gguf(monkeypatch):
    """Packed GGUF blocks are read by the CPU kernels or, on a GPU, by the CUDA ones: the record
    names which."""
    from types import SimpleNamespace

    import torch

    from tinyvllm.bench import common, engine_runs

    monkeypatch.setattr(engine_runs, "is_packed", lambda engine: True)
    for device, kernels in (("cpu", "CPU"), ("cuda", "GPU")):
        runner = SimpleNamespace(loaded=SimpleNamespace(path="models/smollm2.Q4_1.gguf"),
                                 device=torch.device(device))
        engine = SimpleNamespace(executor=SimpleNamespace(runner=runner))
        assert common._weight_format(engine) == f"GGUF Q4_1 blocks kept packed ({kernels} kernels)"


def test_table_titles_name_the_weights_format():
    """A quantized run's title says so; plain float weights (and a GGUF dequantized at load)
    keep the bare model and dtype."""
    from tinyvllm.bench.common import model_label

    record = {"model_name": "llama3-8b-shape", "dtype": "bfloat16"}
    assert model_label({**record, "quantization": "fp8"}) == (
        "llama3-8b-shape bfloat16, weights fp8")
    assert model_label({**record, "quantization": "none"}) == "llama3-8b-shape bfloat16"
    assert model_label({**record, "quantization": "none (GGUF Q4_1 dequantized at load)"}) == (
        "llama3-8b-shape bfloat16")
    assert model_label(record) == "llama3-8b-shape bfloat16"


def test_kernels_only_cpu_times_the_packed_linear_without_a_gpu(tmp_path, monkeypatch, capsys):
    """`bench kernels --only cpu` times the CPU's packed GGUF linear (here one K-quant and one
    32-value type, on the portable kernels, one short batch each) against torch, records JSON
    and prints the ratio."""
    import json

    from tinyvllm.bench import kernels

    monkeypatch.setattr(kernels, "cpu_rows", lambda quick: [
        kernels.bench_cpu_linear(t, 1, "tiny", 16, 256, "scalar") for t in ("Q4_K", "Q8_0")])
    out = tmp_path / "k.json"
    kernels.main(["--only", "cpu", "--quick", "--out", str(out)])
    record = json.loads(out.read_text())
    assert [r["name"] for r in record["results"]] == ["cpu Q4_K", "cpu Q8_0"]
    assert all(r["us"] > 0 and r["ratios"]["torch_f32"] > 0 for r in record["results"])
    assert "cpu Q4_K" in capsys.readouterr().out


@pytest.mark.parametrize("async_flag", ["--async-scheduling", "--no-async-scheduling"])
def test_host_times_each_phase_of_a_step(tmp_path, capsys, async_flag):
    """`bench host` drives decode steps over a stubbed forward and records the host time per
    step and per phase for each batch size, then prints them."""
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--batch-sizes", "2", "5", "--input-len", "8",
                 "--output-len", "6", "--rounds", "2", async_flag, "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "host" and record["git_rev"]
    assert record["async_scheduling"] == (async_flag == "--async-scheduling")
    assert [r["batch_size"] for r in record["results"]] == [2, 5]
    for r in record["results"]:
        assert r["num_steps"] >= 6 and r["us_per_step"] > 0
        phases = r["phases_us"]
        assert set(phases) == {"schedule", "apply", "prepare", "sample", "update"}
        assert all(v > 0 for v in phases.values()) and sum(phases.values()) < r["us_per_step"]
    printed = capsys.readouterr().out
    assert "us per decode step" in printed and "per request" in printed
