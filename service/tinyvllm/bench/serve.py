"""`tinyvllm bench serve`: the service over gRPC under Poisson arrivals (BENCHMARKS.md, `serve`).

A server runs as its own process, started here with the engine flags (or named by --target); this
process is the client. For each --request-rate R (requests/s; `inf` sends every request at once),
--num-prompts requests of --input-len random token ids are sent at Poisson arrival times
(exponential gaps of mean 1/R, fixed seed), each asking for --output-len tokens (greedy, EOS
ignored) and streaming them back. Per request:
  * TTFT: send -> first token;  E2E: send -> last token;
  * TPOT: (last token - first token) / (output tokens - 1);
  * ITL: the gaps between consecutive streamed responses.
Per rate: p50 / p99 / mean of each, output tokens/s and requests/s over the rate's wall time, and
the failed requests by gRPC status code. Writes a JSON record (git revision, device, torch,
model, every engine flag, workload, results) and prints a table last.

    tinyvllm bench serve --request-rate 1 4 inf --num-prompts 64 [engine flags...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import socket
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

SERVER_START_TIMEOUT_S = 600.0
"""Model load and warm-up of the server started here (CUDA graphs take a while on a GPU)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request-rate", type=float, nargs="+", default=[1.0, 4.0, math.inf],
                        help="Requests per second, one run each; inf sends all at once.")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="Requests per rate (default: 200 GPU, 32 CPU).")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens (random ids).")
    parser.add_argument("--output-len", "--max-tokens", dest="output_len", type=int, default=None,
                        help="Output tokens per request, EOS ignored (default: 128 GPU, 32 CPU).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompts and arrivals.")
    parser.add_argument("--target", default=None,
                        help="host:port of a running server (default: start one here).")
    parser.add_argument("--out", default=None,
                        help="JSON record path (default: bench-results/serve-<timestamp>.json).")


# --- workload ---------------------------------------------------------------------------------

def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of n requests: a Poisson process of `rate` requests/s, the
    first at 0; all at 0 when rate is inf."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive or inf, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    token_times_s: list[float]
    """Arrival time of each streamed response that carried tokens."""
    num_output_tokens: int
    error: Optional[str] = None
    """gRPC status code name when the request failed."""


async def _one_request(client: Any, prompt: list[int], output_len: int) -> RequestResult:
    import grpc

    start = time.perf_counter()
    times, num_tokens = [], 0
    try:
        async for r in client.generate(prompt, max_tokens=output_len, temperature=0.0,
                                       ignore_eos=True, stream_token_ids=True, stream_text=False):
            if r.token_ids:
                times.append(time.perf_counter() - start)
                num_tokens += len(r.token_ids)
    except grpc.aio.AioRpcError as e:
        return RequestResult(times, num_tokens, error=e.code().name)
    return RequestResult(times, num_tokens)


async def _run_rate(client: Any, prompts: list[list[int]], rate: float, seed: int,
                    output_len: int) -> tuple[list[RequestResult], float]:
    """Send every prompt at its arrival time; the results and the wall time until the last ends."""
    tasks = []
    start = time.perf_counter()
    for prompt, at in zip(prompts, arrival_times(len(prompts), rate, seed)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(_one_request(client, prompt, output_len)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


# --- statistics -------------------------------------------------------------------------------

def _stats_ms(samples_s: Sequence[float]) -> Optional[dict[str, float]]:
    if not samples_s:
        return None
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "count": len(ms)}


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Latency percentiles, throughput and errors of one rate's requests."""
    ok = [r for r in results if r.error is None and r.token_times_s]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    tpot = [(r.token_times_s[-1] - r.token_times_s[0]) / (r.num_output_tokens - 1)
            for r in ok if r.num_output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    output_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "completed": len(ok), "errors": errors, "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s, "output_tokens_per_s": output_tokens / duration_s,
        "ttft": _stats_ms([r.token_times_s[0] for r in ok]), "tpot": _stats_ms(tpot),
        "itl": _stats_ms(itl), "e2e": _stats_ms([r.token_times_s[-1] for r in ok]),
    }


# --- the server -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_argv: list[str]) -> tuple[subprocess.Popen, str]:
    """`tinyvllm serve` with the engine flags, on a free loopback port."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.serve", "--host", "127.0.0.1", "--port",
           str(port), "--metrics-port", "0", "--log-level", "warning", *engine_argv]
    proc = subprocess.Popen(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    return proc, f"127.0.0.1:{port}"


async def _wait_serving(client: Any, proc: Optional[subprocess.Popen]) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before serving "
                               "(see its log above)")
        try:  # in short waits, so that a server that died is noticed
            await client.wait_until_serving(timeout=5.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


# --- the run ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    seed: int


async def _measure(target: str, proc: Optional[subprocess.Popen], workload: Workload,
                   rates: Sequence[float]) -> tuple[Any, dict[float, dict[str, Any]]]:
    from tinyvllm.bench.common import random_prompts
    from tinyvllm.client import AsyncClient

    async with AsyncClient(target) as client:
        await _wait_serving(client, proc)
        info = await client.model_info()
        prompts = random_prompts([workload.input_len] * workload.num_prompts, info.vocab_size,
                                 workload.seed)
        # warm-up: a short prompt, so that it fits whatever the workload asks of the server
        await client.complete(prompts[0][:2], max_tokens=2, ignore_eos=True)
        results = {}
        for rate in rates:
            runs, duration_s = await _run_rate(client, prompts, rate, workload.seed,
                                               workload.output_len)
            results[rate] = summarize(runs, duration_s)
        return info, results


def _device(target: Optional[str], info: Any, config: Any) -> str:
    if target:  # somebody else's server: only what it reports
        return f"{info.device} (server at {target})"
    from tinyvllm.bench.common import device_name
    from tinyvllm.worker.model_runner import resolve_device
    return device_name(resolve_device(config.model.device))


def build_record(args: argparse.Namespace, engine_argv: list[str], config: Any, info: Any,
                 workload: Workload, results: dict[float, dict[str, Any]]) -> dict[str, Any]:
    import torch

    from tinyvllm.bench.common import git_rev

    return {
        "git_rev": git_rev(), "device": _device(args.target, info, config),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": config.model.model or "default (SmolLM2-135M-Instruct GGUF)",
        "model_name": info.model_name, "dtype": info.dtype,
        "quantization": getattr(config.model, "quantization", None) or "none",
        "target": args.target, "engine_argv": engine_argv,
        "engine_config": dataclasses.asdict(config),
        "workload": {**dataclasses.asdict(workload), "greedy": True, "ignore_eos": True,
                     "arrivals": "poisson",
                     "request_rates": [_rate_name(r) for r in results]},
        "results": [{"request_rate": _rate_name(r), **s} for r, s in results.items()],
    }


def _rate_name(rate: float) -> Any:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity


def print_report(results: dict[float, dict[str, Any]]) -> None:
    from tinyvllm.bench.common import print_table

    def ms(stats: Optional[dict[str, float]], key: str) -> Optional[float]:
        return None if stats is None else stats[key]

    rows = [[_rate_name(rate), s["completed"], sum(s["errors"].values()), s["requests_per_s"],
             s["output_tokens_per_s"], ms(s["ttft"], "p50_ms"), ms(s["ttft"], "p99_ms"),
             ms(s["tpot"], "p50_ms"), ms(s["tpot"], "p99_ms"), ms(s["itl"], "p50_ms"),
             ms(s["itl"], "p99_ms")] for rate, s in results.items()]
    print_table("bench serve (gRPC, Poisson arrivals)",
                ["req/s sent", "ok", "errors", "req/s", "out tok/s", "TTFT p50 ms", "p99",
                 "TPOT p50 ms", "p99", "ITL p50 ms", "p99"], rows)


def _workload(args: argparse.Namespace, config: Any) -> Workload:
    from tinyvllm.worker.model_runner import resolve_device

    gpu = args.target is None and resolve_device(config.model.device).type == "cuda"
    return Workload(num_prompts=args.num_prompts or (200 if gpu else 32),
                    input_len=args.input_len, output_len=args.output_len or (128 if gpu else 32),
                    seed=args.seed)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tinyvllm.bench.common import write_record
    from tinyvllm.config import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser(prog="tinyvllm bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args, engine_argv = parser.parse_known_args(argv)
    for rate in args.request_rate:
        arrival_times(1, rate, 0)  # rejects a rate that is not positive before anything starts
    engine_parser = argparse.ArgumentParser(prog="tinyvllm bench serve (engine flags)")
    add_engine_arguments(engine_parser)
    config = engine_config_from_args(engine_parser.parse_args(engine_argv))
    workload = _workload(args, config)

    proc, target = (None, args.target) if args.target else start_server(engine_argv)
    try:
        info, results = asyncio.run(_measure(target, proc, workload, args.request_rate))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    record = build_record(args, engine_argv, config, info, workload, results)
    path = write_record("serve", record, args.out)
    print_report(results)
    print(f"\nrecord: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
