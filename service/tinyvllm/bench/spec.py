"""`tinyvllm bench spec`: the same prompts with speculative decoding on and off, in one run.

Two workloads of text prompts, greedy with ignore_eos so that both runs produce the same number
of tokens: `repetitive` (code editing: the model is asked to rewrite a function with one name
changed and continues by quoting it, which prompt lookup predicts) and `open` (open questions
whose answers quote little). Each workload runs at each batch size with speculation off, then on
(the speculative config from `--speculative-config`, default n-gram with k = 7: on a GPU a
verification of k + 1 = 8 rows replays the same graph bucket as k = 4, at the same cost), on one loaded
model (with a draft model, the runner holds it for both runs). Reports output and decode
tokens/s, their on / off ratio, the time of a decode step (once every request has its first
token; with speculation a step verifies and, with a draft model, drafts), the acceptance rate,
the mean accepted length (tokens per verification step) and whether the outputs are identical.
Each pair runs `--rounds` times (off, on, off, on, ...); the table shows the round with the
median decode ratio, and every round's ratio is printed and recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

from tinyvllm.bench.common import (engine_config, environment, model_fields, model_label, prepare,
                                   print_table, ratio, write_record)
from tinyvllm.bench.engine_runs import build_engine, frozen_heap, greedy
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.scheduling.request import EngineCoreRequest
from tinyvllm.worker.model_runner import ModelRunner

NAME = "spec"
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}

_FUNCTIONS = [
    ("total_price", "def total_price(items, tax_rate):\n    subtotal = 0.0\n    for item in items:\n"
     "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
     "    return round(subtotal + tax, 2)\n"),
    ("count_words", "def count_words(text):\n    counts = {}\n    for word in text.lower().split():\n"
     "        word = word.strip('.,;:!?')\n        if word:\n"
     "            counts[word] = counts.get(word, 0) + 1\n    return counts\n"),
    ("merge_sorted", "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n"
     "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
     "            result.append(left[i])\n            i += 1\n        else:\n"
     "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
     "    result.extend(right[j:])\n    return result\n"),
    ("parse_config", "def parse_config(lines):\n    config = {}\n    for line in lines:\n"
     "        line = line.strip()\n        if not line or line.startswith('#'):\n"
     "            continue\n        key, _, value = line.partition('=')\n"
     "        config[key.strip()] = value.strip()\n    return config\n"),
]
_QUESTIONS = [
    "Explain why the sky is blue to a ten year old.",
    "What are three good habits for staying healthy?",
    "Describe the water cycle in a few sentences.",
    "Why do cats purr?",
    "Give some advice for a first job interview.",
    "What is the difference between weather and climate?",
    "How does a bicycle stay upright?",
    "Suggest a plan for learning to play the guitar.",
]


def prompts_for(workload: str, batch_size: int) -> list[str]:
    """batch_size prompts of the workload (cycled, each one different)."""
    out = []
    for i in range(batch_size):
        if workload == "repetitive":
            name, code = _FUNCTIONS[i % len(_FUNCTIONS)]
            new = f"{name}_v{i + 2}"
            out.append(f"Rename the function `{name}` to `{new}` and print the whole code, "
                       f"changing nothing else.\n\n```python\n{code}```\n\nThe code with "
                       f"`{new}`:\n\n```python\n")
        else:
            out.append(f"Question {i + 1}: {_QUESTIONS[i % len(_QUESTIONS)]}\nAnswer:")
    return out


def run_once(engine: EngineCore, prompts: list[list[int]], output_len: int, sync
             ) -> dict[str, Any]:
    """All prompts at once, to completion: tokens, output and decode tokens/s, spec counters.

    Starts with the engine's prefix cache empty: the two engines share one KV cache's memory,
    each with its own block pool, so a block one engine's cache still names may since hold the
    other's tokens (and a hit would make the runs unequal anyway). The heap is frozen while it
    runs (`frozen_heap`), as in the other benchmarks' runs."""
    with frozen_heap():
        return _run_once(engine, prompts, output_len, sync)


def _run_once(engine: EngineCore, prompts: list[list[int]], output_len: int, sync
              ) -> dict[str, Any]:
    if not engine.reset_prefix_cache():
        raise RuntimeError("bench spec: the prefix cache could not be reset (blocks in use)")
    before = engine.get_stats()
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    first_s: dict[str, float] = {}
    sync()
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=ids,
                                             sampling_params=greedy(output_len)))
    decode_steps = 0  # steps once every request has its first token
    kinds = {kind: [0, 0.0, 0] for kind in STEP_KINDS}  # kind -> [steps, seconds, tokens]
    stats = engine.scheduler.spec.stats
    while engine.has_unfinished_requests():
        decoding = len(first_s) == len(prompts)
        decode_steps += decoding
        drafts_before, step_start = stats.num_drafts, time.perf_counter()
        outputs = engine.step()
        step_end = time.perf_counter()
        now = step_end - start
        for out in outputs:
            first_s.setdefault(out.request_id, now)
            tokens[out.request_id] += out.new_token_ids
        if decoding:
            emitted = sum(len(out.new_token_ids) for out in outputs)
            kind = kinds[_step_kind(engine, stats.num_drafts > drafts_before, emitted)]
            kind[0] += 1
            kind[1] += step_end - step_start
            kind[2] += emitted
    sync()
    elapsed = time.perf_counter() - start
    after = engine.get_stats()
    num_out = sum(len(t) for t in tokens.values())
    decode_s = elapsed - max(first_s.values())  # after every request's first token
    drafts = after.spec_num_drafts - before.spec_num_drafts
    draft_tokens = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "elapsed_s": elapsed, "num_output_tokens": num_out,
        "output_tokens_per_s": num_out / elapsed,
        "decode_tokens_per_s": (num_out - len(prompts)) / decode_s if decode_s > 0 else None,
        "decode_steps": decode_steps,
        "ms_per_decode_step": 1e3 * decode_s / decode_steps if decode_steps else None,
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "steps": {kind: {"steps": n, "ms_per_step": 1e3 * sec / n if n else None,
                         "tokens_per_step": toks / n if n else None}
                  for kind, (n, sec, toks) in kinds.items()},
    }


STEP_KINDS = ("verified", "ahead", "sync", "dropped")
"""A decode step as `run_once` counts it: it verified drafts, or it was a plain step that left
the next one in flight (async scheduling), or a plain one that did not (synchronous), or one
whose work was all dropped (scheduled behind a verification that fell short: no tokens)."""


def _step_kind(engine: EngineCore, verified: bool, emitted: int) -> str:
    if verified:
        return "verified"
    if not emitted:
        return "dropped"
    return "ahead" if engine.has_step_in_flight else "sync"


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit(f"bench spec: --rounds must be at least 1, got {args.rounds}")
    device, sync = prepare(args)
    spec = dataclasses.asdict(engine_config(args).speculative)
    if spec["method"] is None:
        spec = DEFAULT_SPEC
    config_off = engine_config(args, method=None)
    config_on = dataclasses.replace(config_off, speculative=type(config_off.speculative)(**spec))
    # One model and KV cache, the engines take turns. The runner is built for speculation (its
    # verification and draft graphs; a draft model drafts only for steps that ask, the "on"
    # engine's), but a separate draft checkpoint catches up on every step and turns the decode
    # graphs off, for the "off" engine too.
    runner = ModelRunner(config_on)
    tokenizer = runner.loaded.tokenizer
    engines = {"off": build_engine(config_off, runner), "on": build_engine(config_on, runner)}
    warm = [tokenizer.encode(p) for p in prompts_for("repetitive", 2)]
    for engine in engines.values():  # first touch of the cache and allocator, both paths
        run_once(engine, warm, 8, sync)
    graph_ms = graph_times(runner, config_on.speculative.num_speculative_tokens)
    results = []
    for workload in args.workloads:
        for batch_size in args.batch_sizes:
            prompts = [tokenizer.encode(p) for p in prompts_for(workload, batch_size)]
            rounds = [_compare(workload, batch_size,
                               run_once(engines["off"], prompts, args.output_len, sync),
                               run_once(engines["on"], prompts, args.output_len, sync))
                      for _ in range(args.rounds)]
            results.append(median_round(rounds))
    record = {**environment(args, device), **model_fields(engines["on"], config_on),
              "workload": {"output_len": args.output_len, "sampling": "greedy, ignore_eos",
                           "speculative_config": spec}, "results": results,
              "graph_ms": graph_ms}
    for engine in engines.values():
        engine.shutdown()
    path = write_record(NAME, record, args.out)
    print(f"wrote {path}")
    table(record)
    return 0


def graph_times(runner: ModelRunner, k: int, iters: int = 20) -> dict[str, float]:
    """GPU milliseconds of one replay of each graph a batch-1 request's step uses: a decode, a
    verification of k drafts (k + 1 rows), and a draft step when the runner drafts. Rows are
    padding (a context of one token), so this is the weights' and launches' cost, which the
    contexts of short requests add little to. Empty without graphs."""
    sets = {"decode": (runner.graphs, 1), "verification": (runner.verify_graphs, k + 1)}
    drafter = runner.drafter
    if drafter is not None and drafter.graphs is not None:
        sets["draft_step"] = (drafter.graphs, 1)
    out = {}
    for name, (graphs, rows) in sets.items():
        key = graphs.pick(rows, 1) if graphs is not None else None
        if key is None:
            continue
        graphs.fill_padding(key)
        graphs.replay(key)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graphs.replay(key)
        end.record()
        end.synchronize()
        out[name] = start.elapsed_time(end) / iters
    return out


def _compare(workload: str, batch_size: int, off: dict, on: dict) -> dict[str, Any]:
    identical = off.pop("tokens") == on.pop("tokens")
    return {"workload": workload, "batch_size": batch_size, "off": off, "on": on,
            "identical_outputs": identical,
            "output_tokens_per_s_ratio": ratio(on["output_tokens_per_s"],
                                               off["output_tokens_per_s"]),
            "decode_tokens_per_s_ratio": ratio(on["decode_tokens_per_s"],
                                               off["decode_tokens_per_s"]),
            "step_cost_ratio": ratio(on["ms_per_decode_step"], off["ms_per_decode_step"])}


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose decode tokens/s ratio is the median (the lower middle of an even count),
    with every round's ratios beside it: a run of either engine is milliseconds of steps whose
    pace moves with the host's, so a single pair can show a gain or loss that is not there."""
    order = sorted(rounds, key=lambda r: r["decode_tokens_per_s_ratio"] or 0.0)
    median = dict(order[(len(order) - 1) // 2])
    median["identical_outputs"] = all(r["identical_outputs"] for r in rounds)
    median["rounds"] = [{key: r[key] for key in ("output_tokens_per_s_ratio",
                                                 "decode_tokens_per_s_ratio")} for r in rounds]
    return median


def table(record: dict) -> None:
    header = ["workload", "batch", "off tok/s", "on tok/s", "ratio", "decode ratio",
              "step ms off", "step ms on", "accept rate", "mean accepted len", "identical"]
    rows = [[r["workload"], r["batch_size"], r["off"]["output_tokens_per_s"],
             r["on"]["output_tokens_per_s"], r["output_tokens_per_s_ratio"],
             r["decode_tokens_per_s_ratio"], r["off"]["ms_per_decode_step"],
             r["on"]["ms_per_decode_step"], r["on"]["acceptance_rate"],
             r["on"]["mean_accepted_length"], r["identical_outputs"]]
            for r in record["results"]]
    print_table(f"spec: {model_label(record)} on {record['device']}, "
                f"{record['workload']['output_len']} out, {record['workload']['speculative_config']}",
                header, rows)
    print("decode steps by kind, 'on' runs (steps, ms per step, tokens per step): "
          "verified drafts / plain, next step in flight / plain, synchronous / dropped (behind "
          "a verification that fell short)")
    for r in record["results"]:
        parts = [f"{kind} {s['steps']} x {s['ms_per_step']:.3f} ms, {s['tokens_per_step']:.2f} tok"
                 if s["steps"] else f"{kind} 0" for kind, s in r["on"]["steps"].items()]
        print(f"  {r['workload']} b{r['batch_size']}: " + "; ".join(parts))
    if any(len(r["rounds"]) > 1 for r in record["results"]):
        print("decode ratio of each round (the table shows the median round):")
        for r in record["results"]:
            ratios = ", ".join(f"{x['decode_tokens_per_s_ratio']:.3f}" for x in r["rounds"])
            print(f"  {r['workload']} b{r['batch_size']}: {ratios}")
    graph_ms = record.get("graph_ms") or {}
    if "decode" in graph_ms and "verification" in graph_ms:
        parts = ", ".join(f"{name} {ms:.3f}" for name, ms in graph_ms.items())
        k = record["workload"]["speculative_config"]["num_speculative_tokens"]
        print(f"graph replays, ms (batch 1): {parts}; a verification of k = {k} costs "
              f"{graph_ms['verification'] / graph_ms['decode']:.2f}x a decode step")
