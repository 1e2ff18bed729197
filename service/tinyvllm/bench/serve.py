"""Cost of the service layer: the same workload over gRPC and through `LLM.generate`.

For each concurrency level C: NUM_REQUESTS greedy requests (fixed output length, EOS ignored).
  * gRPC: C client tasks, each sending its next request as soon as the previous one finishes,
    against a `tinyvllm serve` started here (or --target). TTFT is measured by the client.
  * offline: `LLM.generate` in waves of C prompts; TTFT = first token time - arrival time.
Both run in the same invocation, level by level, back to back.
Prints a table with the gRPC/offline ratios and writes JSON.

    python -m tinyvllm.bench.serve --num-requests 64 --max-tokens 16 [engine flags...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def quicksort(xs):",
           "Explain photosynthesis in one sentence.", "The three laws of robotics are",
           "Once upon a time, in a small village,", "List five prime numbers:",
           "What is the boiling point of water?"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-requests", type=int, default=64, help="Requests per level.")
    parser.add_argument("--max-tokens", type=int, default=16, help="Output tokens per request.")
    parser.add_argument("--target", default=None,
                        help="host:port of a running server (default: start one here).")
    parser.add_argument("--skip-offline", action="store_true", help="Only measure gRPC.")
    parser.add_argument("--output", default="bench-results/serve.json", help="JSON result file.")


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _summary(ttfts: list[float], elapsed_s: float) -> dict[str, float]:
    return {"requests_per_s": len(ttfts) / elapsed_s, "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p99_s": _percentile(ttfts, 99), "ttft_mean_s": statistics.fmean(ttfts),
            "elapsed_s": elapsed_s}


def _prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(n)]


# --- gRPC -------------------------------------------------------------------------------------

async def _grpc_level(target: str, concurrency: int, prompts: list[str], max_tokens: int
                      ) -> dict[str, float]:
    from tinyvllm.client import AsyncClient

    queue = list(reversed(prompts))
    ttfts: list[float] = []

    async def worker(client: AsyncClient) -> None:
        while queue:
            prompt = queue.pop()
            start = time.perf_counter()
            first: Optional[float] = None
            async for r in client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True, stream_token_ids=True):
                if first is None and r.token_ids:
                    first = time.perf_counter() - start
            ttfts.append(first)

    async with AsyncClient(target) as client:
        await client.wait_until_serving()
        await client.complete("warm up", max_tokens=2)
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return _summary(ttfts, time.perf_counter() - start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(engine_argv: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.serve", "--host", "127.0.0.1", "--port",
           str(port), "--metrics-port", "0", "--log-level", "warning", *engine_argv]
    proc = subprocess.Popen(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    return proc, f"127.0.0.1:{port}"


class GrpcRunner:
    """A server started here (or --target) and the closed-loop gRPC workload against it."""

    def __init__(self, args: argparse.Namespace, engine_argv: list[str]) -> None:
        self.args = args
        self.proc, self.target = ((None, args.target) if args.target
                                  else _start_server(engine_argv))

    def level(self, concurrency: int) -> dict[str, float]:
        return asyncio.run(_grpc_level(self.target, concurrency, _prompts(self.args.num_requests),
                                       self.args.max_tokens))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


# --- offline ----------------------------------------------------------------------------------

class OfflineRunner:
    """`LLM.generate` over the same prompts, in waves of `concurrency`."""

    def __init__(self, args: argparse.Namespace, engine_config: Any) -> None:
        from tinyvllm.entrypoints.llm import LLM
        from tinyvllm.sampling_params import SamplingParams

        self.args = args
        self.llm = LLM.from_config(engine_config)
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                     ignore_eos=True)
        self.llm.generate(["warm up"], self.params.clone(max_tokens=2), use_tqdm=False)

    def level(self, concurrency: int) -> dict[str, float]:
        prompts = _prompts(self.args.num_requests)
        ttfts: list[float] = []
        start = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            for out in self.llm.generate(prompts[i:i + concurrency], self.params,
                                         use_tqdm=False):
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        return _summary(ttfts, time.perf_counter() - start)


# --- report -----------------------------------------------------------------------------------

def report(grpc_results: dict, offline: dict) -> list[dict[str, Any]]:
    rows = []
    print(f"{'C':>3} {'gRPC req/s':>11} {'offline':>9} {'ratio':>6} | {'TTFT p50 gRPC':>13} "
          f"{'offline':>8} {'ratio':>6} | {'TTFT p99 gRPC':>13} {'offline':>8} {'ratio':>6}")
    for c, g in grpc_results.items():
        o = offline.get(c)
        row = {"concurrency": c, "grpc": g, "offline": o}
        if o:
            row["ratio"] = {"requests_per_s": g["requests_per_s"] / o["requests_per_s"],
                            "ttft_p50": g["ttft_p50_s"] / o["ttft_p50_s"],
                            "ttft_p99": g["ttft_p99_s"] / o["ttft_p99_s"]}
            r = row["ratio"]
            print(f"{c:>3} {g['requests_per_s']:>11.2f} {o['requests_per_s']:>9.2f} "
                  f"{r['requests_per_s']:>6.2f} | {g['ttft_p50_s']:>13.3f} {o['ttft_p50_s']:>8.3f} "
                  f"{r['ttft_p50']:>6.2f} | {g['ttft_p99_s']:>13.3f} {o['ttft_p99_s']:>8.3f} "
                  f"{r['ttft_p99']:>6.2f}")
        else:
            print(f"{c:>3} {g['requests_per_s']:>11.2f} {'-':>9} {'-':>6} | "
                  f"{g['ttft_p50_s']:>13.3f} {'-':>8} {'-':>6} | {g['ttft_p99_s']:>13.3f}")
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tinyvllm.config import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser(prog="tinyvllm-bench-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args, engine_argv = parser.parse_known_args(argv)
    engine_parser = argparse.ArgumentParser(prog="engine flags")
    add_engine_arguments(engine_parser)
    engine_config = engine_config_from_args(engine_parser.parse_args(engine_argv))

    # Both sides are set up first and measured back to back per level, so that drift in the
    # machine's load hits them alike. The idle server blocks on its socket and costs no CPU.
    grpc_runner = GrpcRunner(args, engine_argv)
    try:
        offline_runner = None if args.skip_offline else OfflineRunner(args, engine_config)
        grpc_results, offline = {}, {}
        for c in args.concurrency:
            grpc_results[c] = grpc_runner.level(c)
            if offline_runner is not None:
                offline[c] = offline_runner.level(c)
    finally:
        grpc_runner.close()
    rows = report(grpc_results, offline)
    result = {"num_requests": args.num_requests, "max_tokens": args.max_tokens,
              "engine_args": engine_argv, "levels": rows}
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
