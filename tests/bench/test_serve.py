"""`tinyvllm bench serve`: Poisson arrivals, and a tiny run against a real server on loopback."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tinyvllm.bench.serve import RequestResult, arrival_times, summarize
from tinyvllm.entrypoints.cli import main

RECORD_KEYS = {"benchmark", "git_rev", "device", "torch", "cuda", "model", "dtype",
               "quantization", "engine_config", "workload", "results"}


def test_arrivals_are_poisson_at_the_rate():
    times = arrival_times(20000, 8.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    # exponential gaps: standard deviation equals the mean
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.05)
    assert arrival_times(50, 8.0, seed=1) == times[:50]  # fixed seed, same schedule
    assert arrival_times(4, math.inf, seed=1) == [0.0] * 4


@pytest.mark.parametrize("rate", [0.0, -2.0])
def test_rate_must_be_positive(rate):
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_times(3, rate, seed=0)


def test_summary_latencies_and_errors():
    results = [RequestResult([0.1, 0.3, 0.5], 3), RequestResult([0.2, 0.25], 4),
               RequestResult([], 0, error="RESOURCE_EXHAUSTED")]
    s = summarize(results, duration_s=2.0)
    assert s["completed"] == 2 and s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["output_tokens_per_s"] == pytest.approx(3.5) and s["requests_per_s"] == 1.0
    assert s["ttft"]["count"] == 2 and s["ttft"]["p50_ms"] == pytest.approx(150.0)
    # TPOT: (0.5 - 0.1) / 2 and (0.25 - 0.2) / 3; ITL: 0.2, 0.2, 0.05
    assert s["tpot"]["mean_ms"] == pytest.approx((200.0 + 50.0 / 3) / 2)
    assert s["itl"]["count"] == 3 and s["itl"]["mean_ms"] == pytest.approx(150.0)
    assert s["e2e"]["p99_ms"] == pytest.approx(500.0, rel=0.01)


@pytest.mark.slow
def test_serve_writes_a_record(tmp_path, smollm2_path, capsys):
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--request-rate", "20", "inf", "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "4", "--out", str(out),
                 "--max-num-seqs", "4", "--max-model-len", "64"]) == 0
    record = json.loads(out.read_text())
    assert RECORD_KEYS <= record.keys() and record["benchmark"] == "serve"
    assert record["git_rev"] and record["device"].startswith("cpu")
    assert record["engine_config"]["scheduler"]["max_num_seqs"] == 4
    assert record["workload"]["arrivals"] == "poisson"
    assert record["workload"]["request_rates"] == [20.0, "inf"]
    for level in record["results"]:
        assert level["completed"] == 3 and level["errors"] == {}
        assert level["output_tokens_per_s"] > 0
        for key in ("ttft", "tpot", "e2e"):
            assert level[key]["count"] == 3 and 0 < level[key]["p50_ms"] <= level[key]["p99_ms"]
        assert 3 <= level["itl"]["count"] <= 9  # 3 gaps per request, fewer when tokens batch up
    table = capsys.readouterr().out
    assert "TTFT p50 ms" in table and "ITL p50 ms" in table


@pytest.mark.slow
def test_serve_counts_failed_requests(tmp_path, smollm2_path):
    """Prompts longer than the server's context fail with INVALID_ARGUMENT, counted, not hidden."""
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--request-rate", "inf", "--num-prompts", "2",
                 "--input-len", "40", "--output-len", "4", "--out", str(out),
                 "--max-model-len", "32"]) == 0
    (level,) = json.loads(out.read_text())["results"]
    assert level["errors"] == {"INVALID_ARGUMENT": 2} and level["completed"] == 0
    assert level["ttft"] is None
