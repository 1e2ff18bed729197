"""`tinyvllm bench throughput`: every request submitted at once, run to completion.

`random`: every prompt `--input-len` random tokens, every output `--output-len` tokens.
`mixed`: prompt and output lengths drawn from lognormals around those means (fixed seed).
Reports output tokens/s and requests/s; the transformers baseline runs the same prompts in chunks
of `--baseline-batch-size`, left-padded.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from tinyvllm.bench import baseline as hf
from tinyvllm.bench.common import (default_for, engine_config, environment, lognormal_lengths,
                                   model_fields, model_label, prepare, print_table, random_prompts,
                                   ratio, summary_ms, write_record)
from tinyvllm.bench.engine_runs import BatchRun, build_engine, free_memory, run_batch

NAME = "throughput"
WARMUP_PROMPTS = 4
WARMUP_TOKENS = 8


def workload(args: argparse.Namespace, device, vocab_size: int, seed: int,
             max_model_len: Optional[int] = None
             ) -> tuple[list[list[int]], list[int], dict[str, Any]]:
    """(prompts, output lengths, description) for --workload, with device-dependent defaults.
    Mixed lengths are cut so that prompt + output fit `max_model_len` (the cut ones counted)."""
    n = args.num_prompts or default_for(device, 1000, 64)
    input_len = args.input_len or default_for(device, 1024, 128)
    output_len = args.output_len or 128
    num_cut = 0
    if args.workload == "mixed":
        in_lens = lognormal_lengths(n, input_len, seed)
        out_lens = lognormal_lengths(n, output_len, seed + 1)
        if max_model_len is not None:
            out_lens = [min(o, max_model_len // 2) for o in out_lens]
            fitted = [max(1, min(i, max_model_len - o)) for i, o in zip(in_lens, out_lens)]
            num_cut = sum(f != i for f, i in zip(fitted, in_lens))
            in_lens = fitted
    else:
        in_lens, out_lens = [input_len] * n, [output_len] * n
    described = {"name": args.workload, "num_prompts": n, "input_len": input_len,
                 "num_cut_to_max_model_len": num_cut,
                 "output_len": output_len, "total_prompt_tokens": sum(in_lens),
                 "total_output_tokens": sum(out_lens), "sampling": "greedy, ignore_eos",
                 "seed": seed}
    return random_prompts(in_lens, vocab_size, seed), out_lens, described


def ours_numbers(run: BatchRun) -> dict[str, Any]:
    return {**run.rates(), "ttft": summary_ms([r.ttft_s for r in run.requests]),
            "itl": summary_ms([s for r in run.requests for s in r.inter_token_s] or [0.0])}


def warm_up(engine, vocab_size: int, seed: int, sync) -> None:
    """A few short requests: first-touch of the KV cache and allocator, batched kernels."""
    prompts = random_prompts([64] * WARMUP_PROMPTS, vocab_size, seed + 1000)
    run_batch(engine, prompts, [WARMUP_TOKENS] * WARMUP_PROMPTS, sync)


def run(args: argparse.Namespace) -> int:
    device, sync = prepare(args)
    config = engine_config(args)
    engine = build_engine(config)
    vocab, seed = engine.runtime_info.vocab_size, config.model.seed
    prompts, out_lens, described = workload(args, device, vocab, seed,
                                            engine.runtime_info.max_model_len)
    warm_up(engine, vocab, seed, sync)
    ours = ours_numbers(run_batch(engine, prompts, out_lens, sync))
    record = {**environment(args, device), **model_fields(engine, config), "workload": described,
              "results": {"tinyvllm": ours}}
    spec = hf.ModelSpec.of(engine) if args.baseline else None
    engine.shutdown()
    engine = None
    free_memory()
    if args.baseline:
        record["baseline"], base = run_baseline(spec, prompts, out_lens, args, device, sync)
        record["results"]["transformers"] = base
        record["ratios"] = {k: ratio(ours[k], base[k])
                            for k in ("output_tokens_per_s", "requests_per_s")}
    path = write_record(NAME, record, args.out)
    print(f"wrote {path}")
    table(record)
    return 0


def run_baseline(spec, prompts, out_lens, args, device, sync) -> tuple[dict, dict]:
    """transformers on the same prompts, in chunks of --baseline-batch-size."""
    b = hf.load_baseline(spec, compile=args.baseline_compile)
    batch_size = args.baseline_batch_size or default_for(device, 64, 8)
    numbers = hf.run_batched(b, prompts, out_lens, batch_size, sync)
    described = b.describe()
    b.model = None
    free_memory()
    return described, numbers


def table(record: dict) -> None:
    header = ["engine", "output tok/s", "requests/s", "elapsed s", "TTFT p50 ms", "TTFT p99 ms"]
    rows = []
    for name, r in record["results"].items():
        ttft = r.get("ttft") or {}
        rows.append([name, r["output_tokens_per_s"], r["requests_per_s"], r["elapsed_s"],
                     ttft.get("median_ms"), ttft.get("p99_ms")])
    if "ratios" in record:
        q = record["ratios"]
        rows.append(["ours/transformers", q["output_tokens_per_s"], q["requests_per_s"], None,
                     None, None])
    w = record["workload"]
    print_table(f"throughput: {model_label(record)} on {record['device']}, "
                f"{w['name']} {w['num_prompts']} x {w['input_len']} in / {w['output_len']} out",
                header, rows)
