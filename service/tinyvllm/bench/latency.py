"""`tinyvllm bench latency`: one request at a time (batch 1), greedy, every token forced.

TTFT is the time from submission to the first token (prefill + first sample); TPOT the time
between consecutive tokens (median and p99 over every decode step of every timed request).
The median decode step is also set against the memory-bandwidth floor: the bytes a step must
read (all weights + the KV cache of the context at the median step) over the bandwidth measured
at the start of this run (GPU: device copy; CPU: a streaming read). On the CPU, when the engine
runs packed GGUF weights, the `--dequantize` float path (today's CPU path before the kernels)
runs beside it, and llama.cpp on the same file when `llama-cpp-python` is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from tinyvllm.bench import baseline as hf
from tinyvllm.bench import cpu_baselines as cpu
from tinyvllm.bench import kernel_profile
from tinyvllm.bench.common import (copy_bandwidth_gbps, default_for, engine_config, environment,
                                   model_fields, model_label, prepare, print_table, random_prompts,
                                   ratio, summary_ms, write_record)
from tinyvllm.bench.engine_runs import (build_engine, free_memory, is_packed, kv_bytes_per_token,
                                        local_runner, run_batch, weight_bytes)

NAME = "latency"
CPU_WARMUP_TOKENS = 16  # CPU has nothing to compile or capture; a short request warms caches


def numbers(token_times: Sequence[Sequence[float]]) -> dict[str, Any]:
    """TTFT, TPOT and tokens/s from per-request token timestamps (seconds since submission)."""
    ttft = [t[0] for t in token_times]
    itl = [b - a for t in token_times for a, b in zip(t, t[1:])]
    tpot = summary_ms(itl)
    return {"ttft": summary_ms(ttft), "tpot": tpot,
            "decode_tokens_per_s": 1e3 / tpot["median_ms"],
            "e2e_tokens_per_s": statistics.median(len(t) / t[-1] for t in token_times)}


def roofline(engine, input_len: int, output_len: int, tpot_ms: float,
             copy_gbps: Optional[float]) -> Optional[dict[str, Any]]:
    """Fraction of the bandwidth floor achieved by the median decode step (on the CPU against
    the streaming-read bandwidth measured in this run); None when the model runs in worker
    processes."""
    if copy_gbps is None or local_runner(engine) is None:
        return None
    weights = weight_bytes(engine)
    kv = kv_bytes_per_token(engine) * (input_len + output_len // 2)  # context of the median step
    floor_ms = (weights + kv) / (copy_gbps * 1e9) * 1e3
    return {"copy_bandwidth_gbps": copy_gbps, "weight_bytes": weights, "kv_bytes_median_step": kv,
            "floor_ms": floor_ms, "fraction_of_floor": floor_ms / tpot_ms,
            "achieved_gbps": (weights + kv) / (tpot_ms * 1e-3) / 1e9}


def run(args: argparse.Namespace) -> int:
    device, sync = prepare(args)
    if args.profile_kernels < 0 or (args.profile_kernels and device.type != "cuda"):
        print(f"--profile-kernels {args.profile_kernels}: needs a positive step count and a CUDA "
              f"device (this run is on {device})", file=sys.stderr)
        return 2
    copy_gbps = copy_bandwidth_gbps(device)  # before the engine claims the GPU's memory
    if device.type == "cpu":
        copy_gbps = cpu.stream_read_gbps()
    config = engine_config(args)
    engine = build_engine(config)
    num_iters = args.num_iters or default_for(device, 10, 3)
    prompts = random_prompts([args.input_len] * (num_iters + 1), engine.runtime_info.vocab_size,
                             config.model.seed)
    spec = hf.ModelSpec.of(engine) if args.baseline else None
    # On CPU both models fit: alternate their requests so that drift in a shared machine's load
    # hits both alike. On GPU one engine claims most of the memory, so the baseline runs after.
    interleave = args.baseline and device.type == "cpu"
    b = hf.load_baseline(spec, compile=args.baseline_compile) if interleave else None
    extras = cpu_contenders(args, config, engine, device)
    ours_times, base_times = time_requests(engine, b, prompts, args.output_len, device, sync,
                                           {name: run for name, (_, run) in extras.items()})
    ours = numbers(ours_times.pop("tinyvllm"))
    ours["bandwidth"] = roofline(engine, args.input_len, args.output_len,
                                 ours["tpot"]["median_ms"], copy_gbps)
    others = {name: numbers(times) for name, times in ours_times.items()}
    record = {**environment(args, device), **model_fields(engine, config),
              "workload": {"batch_size": 1, "input_len": args.input_len,
                           "output_len": args.output_len, "num_iters": num_iters,
                           "sampling": "greedy, ignore_eos", "interleaved": interleave},
              "results": {"tinyvllm": ours, **others}}
    for name, (describe, _) in extras.items():
        record.setdefault("contenders", {})[name] = describe
        record.setdefault("ratios_to", {})[name] = ratios(ours, others[name])
    profiled = None
    if args.profile_kernels:
        profiled = kernel_profile.profile_decode(engine, prompts[0], args.profile_kernels, sync)
        record["kernel_profile"] = profiled.as_record()
    engine.shutdown()
    engine = None
    free_memory()
    if args.baseline:
        if b is None:
            b = hf.load_baseline(spec, compile=args.baseline_compile)
            _, base_times = time_requests(None, b, prompts, args.output_len, device, sync)
        record["baseline"] = b.describe()
        record["results"]["transformers"] = numbers(base_times)
        record["ratios"] = ratios(ours, record["results"]["transformers"])
    path = write_record(NAME, record, args.out)
    print(f"wrote {path}")
    table(record)
    if profiled is not None and not profiled.kernels:
        print("--profile-kernels: no CUDA activity was recorded in this process (a worker "
              "process runs the model: profile with the in-process executor)", file=sys.stderr)
    elif profiled is not None:
        print_table(f"kernels of {profiled.num_steps} decode steps, us per step (span "
                    f"{profiled.span_us:.1f}, idle {profiled.idle_us:.1f})",
                    ["kernel", "calls", "marginal us", "busy us"],
                    kernel_profile.table_rows(profiled))
        block = profiled.block
        if block is not None:
            print_table(f"a block of {len(block.slots)} launches repeated {block.repeats} times a "
                        f"step (decoder layers), in launch order, us per occurrence",
                        ["#", "kernel", "marginal us", "busy us"],
                        kernel_profile.block_rows(block))
    return 0


def cpu_contenders(args, config, engine, device) -> dict[str, tuple[dict, Callable]]:
    """On the CPU, beside ours: the `--dequantize` float path when ours runs packed weights
    (today's CPU path, for the ratio), and llama.cpp on the same GGUF file when installed.
    name -> (description, run(prompt, output_len) -> token times)."""
    if device.type != "cpu":
        return {}
    out: dict[str, tuple[dict, Callable]] = {}
    if is_packed(engine) and args.compare_dequantized:
        other = build_engine(dataclasses.replace(
            config, model=dataclasses.replace(config.model, dequantize=True)))
        out["tinyvllm --dequantize"] = (
            {"name": "tinyvllm", "dequantize": True},
            lambda p, n: run_batch(other, [p], [n], lambda: None).requests[0].token_times_s)
    runner = local_runner(engine)
    llama = runner and cpu.LlamaCpp.load(Path(str(runner.loaded.path)), torch.get_num_threads(),
                                         args.input_len + args.output_len + 16)
    if llama is not None:
        out["llama.cpp"] = (llama.describe(), llama.time_single)
    return out


def time_requests(engine, b: Optional[hf.HFBaseline], prompts, output_len: int, device, sync,
                  extras: Optional[dict[str, Callable]] = None
                  ) -> tuple[dict[str, list[list[float]]], list[list[float]]]:
    """Warm up, then each timed prompt through the engine, the extra contenders and/or the
    baseline, alternating; ({"tinyvllm": ..., extra name: ...}, baseline) token times."""
    extras = extras or {}
    warmup_len = default_for(device, output_len, min(output_len, CPU_WARMUP_TOKENS))
    if engine is not None:
        run_batch(engine, prompts[:1], [warmup_len], sync)
    for run_one in extras.values():
        run_one(prompts[0], warmup_len)
    if b is not None:
        hf.warm_up_single(b, prompts[0], output_len, sync)
    ours: dict[str, list[list[float]]] = {"tinyvllm": [], **{name: [] for name in extras}}
    base = []
    for p in prompts[1:]:
        if engine is not None:
            ours["tinyvllm"].append(
                run_batch(engine, [p], [output_len], sync).requests[0].token_times_s)
        for name, run_one in extras.items():
            ours[name].append(run_one(p, output_len))
        if b is not None:
            base.append(hf.time_single(b, p, output_len, sync))
    return ours, base


def ratios(ours: dict, base: dict) -> dict[str, Optional[float]]:
    """ours / transformers for rates; transformers / ours for times: > 1 means we are faster."""
    return {"decode_tokens_per_s": ratio(ours["decode_tokens_per_s"], base["decode_tokens_per_s"]),
            "e2e_tokens_per_s": ratio(ours["e2e_tokens_per_s"], base["e2e_tokens_per_s"]),
            "ttft_speedup": ratio(base["ttft"]["median_ms"], ours["ttft"]["median_ms"])}


def table(record: dict) -> None:
    header = ["engine", "TTFT ms", "TTFT p99", "TPOT ms", "TPOT p99", "decode tok/s",
              "e2e tok/s", "% BW floor"]
    rows = []
    for name, r in record["results"].items():
        bw = r.get("bandwidth")
        rows.append([name, r["ttft"]["median_ms"], r["ttft"]["p99_ms"], r["tpot"]["median_ms"],
                     r["tpot"]["p99_ms"], r["decode_tokens_per_s"], r["e2e_tokens_per_s"],
                     100 * bw["fraction_of_floor"] if bw else None])
    if "ratios" in record:
        q = record["ratios"]
        rows.append(["ours/transformers", None, None, None, None, q["decode_tokens_per_s"],
                     q["e2e_tokens_per_s"], None])
    for name, q in record.get("ratios_to", {}).items():
        rows.append([f"ours/{name}", None, None, None, None, q["decode_tokens_per_s"],
                     q["e2e_tokens_per_s"], None])
    w = record["workload"]
    print_table(f"latency: {model_label(record)} on {record['device']}, "
                f"batch 1, {w['input_len']} in / {w['output_len']} out", header, rows)
