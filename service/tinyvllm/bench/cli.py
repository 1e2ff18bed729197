"""`tinyvllm bench latency|throughput|prefix|spec|kernels|serve|host` (see BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from tinyvllm.bench import args as bench_args

# name -> (module with run(args), flags, help). The modules import torch, so they load only to run.
_ENGINE_BENCHMARKS = {
    "latency": ("tinyvllm.bench.latency", bench_args.add_latency_arguments,
                "Batch-1 TTFT, TPOT, tokens/s against transformers."),
    "throughput": ("tinyvllm.bench.throughput", bench_args.add_throughput_arguments,
                   "All requests at once: output tokens/s and requests/s against transformers."),
    "prefix": ("tinyvllm.bench.prefix", bench_args.add_prefix_arguments,
               "Requests sharing a long prefix, prefix caching on vs off."),
    "spec": ("tinyvllm.bench.spec", bench_args.add_spec_arguments,
             "Speculative decoding on vs off on the same prompts (repetitive and open)."),
}
_DELEGATED = {  # modules with their own argument parser: the rest of the command line goes there
    "kernels": ("tinyvllm.bench.kernels", "GPU kernels against torch / cuBLAS baselines "
                "(--only cpu: the CPU's packed GGUF linear against torch)."),
    "serve": ("tinyvllm.bench.serve", "The gRPC service under Poisson arrivals: TTFT, TPOT, ITL."),
    "host": ("tinyvllm.bench.host", "Host work per decode step (schedule, inputs, sampling, "
             "update), the model's forward replaced by fixed logits; CPU."),
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="Run a benchmark (BENCHMARKS.md).",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, add_arguments, help_text) in _ENGINE_BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(func=_engine_runner(module))
    for name, (module, help_text) in _DELEGATED.items():
        if importlib.util.find_spec(module) is None:
            continue
        # Its own parser reads every flag, --help included: with no prefix characters of its own
        # this one takes them all as positionals (REMAINDER would stop at a leading flag).
        p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs="*")
        p.set_defaults(func=_delegate(module))


def _engine_runner(module: str):
    def run(args: argparse.Namespace) -> int:
        if args.baseline and not transformers_available():
            # transformers is a test extra, not a runtime dependency: the engine's own numbers
            # stand alone; the ratio column needs `pip install transformers`.
            print("transformers is not installed: skipping the transformers baseline "
                  "(pip install transformers to compare)", file=sys.stderr)
            args.baseline = False
        return importlib.import_module(module).run(args)
    return run


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _delegate(module: str):
    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(module).main(args.rest) or 0)
    return run
