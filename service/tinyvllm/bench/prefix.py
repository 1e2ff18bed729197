"""`tinyvllm bench prefix`: requests sharing a long prefix, prefix caching on vs off.

Every prompt is one shared random prefix followed by its own random suffix; all are submitted at
once. The same loaded model serves two engines in turn, one with prefix caching off and one with
it on, so the only difference is the cache. Reports TTFT, output tokens/s and the prefix hit rate
of each, and their ratios; transformers (which has no cross-request cache) runs the same prompts
as a further baseline unless --no-baseline.
"""

from __future__ import annotations

import argparse
from typing import Any

from tinyvllm.bench import baseline as hf
from tinyvllm.bench.common import (default_for, engine_config, environment, model_fields,
                                   model_label, prepare, print_table, random_prompts, ratio,
                                   write_record)
from tinyvllm.bench.engine_runs import build_engine, free_memory, run_batch
from tinyvllm.bench.throughput import ours_numbers, warm_up
from tinyvllm.worker.model_runner import ModelRunner

NAME = "prefix"


def workload(args: argparse.Namespace, device, vocab_size: int, seed: int
             ) -> tuple[list[list[int]], list[int], dict[str, Any]]:
    n = args.num_prompts or default_for(device, 200, 16)
    prefix_len = args.prefix_len or default_for(device, 2048, 512)
    suffix_len = args.suffix_len or default_for(device, 128, 32)
    output_len = args.output_len or default_for(device, 128, 16)
    prefix = random_prompts([prefix_len], vocab_size, seed)[0]
    suffixes = random_prompts([suffix_len] * n, vocab_size, seed + 1)
    prompts = [prefix + s for s in suffixes]
    described = {"num_prompts": n, "prefix_len": prefix_len, "suffix_len": suffix_len,
                 "output_len": output_len,
                 "shared_fraction": prefix_len / (prefix_len + suffix_len),
                 "sampling": "greedy, ignore_eos", "seed": seed}
    return prompts, [output_len] * n, described


def run(args: argparse.Namespace) -> int:
    device, sync = prepare(args)
    config_on = engine_config(args, enable_prefix_caching=True)
    config_off = engine_config(args, enable_prefix_caching=False)
    runner = ModelRunner(config_on)  # one model and KV cache, two engines in turn
    results: dict[str, Any] = {}
    record: dict[str, Any] = {}
    for label, config in (("caching_off", config_off), ("caching_on", config_on)):
        engine = build_engine(config, runner)
        vocab, seed = engine.runtime_info.vocab_size, config.model.seed
        prompts, out_lens, described = workload(args, device, vocab, seed)
        warm_up(engine, vocab, seed, sync)
        run = run_batch(engine, prompts, out_lens, sync)
        results[label] = {**ours_numbers(run),
                          "prefix_hit_rate": run.num_cached_tokens / run.num_prompt_tokens,
                          "num_cached_tokens": run.num_cached_tokens}
        if not record:
            record = {**environment(args, device), **model_fields(engine, config_on),
                      "workload": described}
        spec = hf.ModelSpec.of(engine)
        engine.shutdown()
    engine = runner = None
    free_memory()
    record["results"] = results
    on, off = results["caching_on"], results["caching_off"]
    record["ratios"] = {
        "on_vs_off_output_tokens_per_s": ratio(on["output_tokens_per_s"],
                                               off["output_tokens_per_s"]),
        "on_vs_off_ttft_speedup": ratio(off["ttft"]["median_ms"], on["ttft"]["median_ms"])}
    if args.baseline:
        b = hf.load_baseline(spec, compile=args.baseline_compile)
        batch_size = args.baseline_batch_size or default_for(device, 64, 8)
        results["transformers"] = hf.run_batched(b, prompts, out_lens, batch_size, sync)
        record["baseline"] = b.describe()
        record["ratios"]["on_vs_transformers_output_tokens_per_s"] = ratio(
            on["output_tokens_per_s"], results["transformers"]["output_tokens_per_s"])
    path = write_record(NAME, record, args.out)
    print(f"wrote {path}")
    table(record)
    return 0


def table(record: dict) -> None:
    header = ["run", "output tok/s", "requests/s", "TTFT p50 ms", "TTFT p99 ms", "hit rate"]
    rows = []
    for name, r in record["results"].items():
        ttft = r.get("ttft") or {}
        rows.append([name, r["output_tokens_per_s"], r["requests_per_s"], ttft.get("median_ms"),
                     ttft.get("p99_ms"), r.get("prefix_hit_rate")])
    w = record["workload"]
    print_table(f"prefix: {model_label(record)} on {record['device']}, "
                f"{w['num_prompts']} x ({w['prefix_len']} shared + {w['suffix_len']}) in / "
                f"{w['output_len']} out", header, rows)
    q = record["ratios"]
    print(f"caching on / off: output tok/s {q['on_vs_off_output_tokens_per_s']:.2f}x, "
          f"TTFT p50 {q['on_vs_off_ttft_speedup']:.2f}x faster")
    if "on_vs_transformers_output_tokens_per_s" in q:
        print(f"caching on / transformers output tok/s: "
              f"{q['on_vs_transformers_output_tokens_per_s']:.2f}x")
