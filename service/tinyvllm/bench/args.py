"""Command-line flags of the engine benchmarks, kept free of torch so that building the `tinyvllm`
parser stays fast. Defaults that depend on the device (GPU or CPU workload sizes) are None here
and resolved when the benchmark runs."""

from __future__ import annotations

import argparse

from tinyvllm.config import add_engine_arguments

RESULTS_DIR = "bench-results"


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of every engine benchmark, then every engine flag (`--model`, `--dtype`, ...)."""
    group = parser.add_argument_group("benchmark")
    group.add_argument("--out", default=None,
                       help=f"JSON record path (default: {RESULTS_DIR}/<name>-<timestamp>.json).")
    group.add_argument("--no-baseline", dest="baseline", action="store_false",
                       help="Skip the Hugging Face transformers baseline.")
    group.add_argument("--baseline-batch-size", type=int, default=None,
                       help="Prompts per transformers generate call (default: 64 GPU, 8 CPU).")
    group.add_argument("--compare-dequantized", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="On the CPU with packed GGUF weights, also run the --dequantize float "
                            "path in the same run (the ratio to the CPU path before the kernels).")
    group.add_argument("--baseline-compile", action=argparse.BooleanOptionalAction, default=True,
                       help="Let transformers torch.compile its static-cache decode on GPU.")
    add_engine_arguments(parser)


def _output_len(group) -> None:
    group.add_argument("--output-len", "--max-tokens", dest="output_len", type=int, default=None,
                       help="Output tokens per request, EOS ignored.")


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("latency workload (batch 1)")
    group.add_argument("--input-len", type=int, default=128, help="Prompt tokens.")
    group.add_argument("--output-len", "--max-tokens", dest="output_len", type=int, default=256,
                       help="Output tokens, EOS ignored.")
    group.add_argument("--num-iters", type=int, default=None,
                       help="Timed requests, each a fresh prompt (default: 10 GPU, 3 CPU).")
    group.add_argument("--profile-kernels", type=int, default=0, metavar="STEPS",
                       help="After the timed requests, record STEPS decode steps of one more "
                       "with torch.profiler and print each kernel's marginal time per step "
                       "(its end minus the previous end: neighbours overlap under PDL), then "
                       "the step's repeated block of launches (a decoder layer) launch by "
                       "launch; CUDA only.")
    add_common_arguments(parser)


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("throughput workload (all requests at once)")
    group.add_argument("--workload", choices=("random", "mixed"), default="random",
                       help="random: fixed lengths; mixed: lognormal lengths around them.")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="Requests (default: 1000 GPU, 64 CPU).")
    group.add_argument("--input-len", type=int, default=None,
                       help="Prompt tokens, the mean for mixed (default: 1024 GPU, 128 CPU).")
    _output_len(group)
    add_common_arguments(parser)


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefix workload (shared prefix, unique suffixes)")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="Requests (default: 200 GPU, 16 CPU).")
    group.add_argument("--prefix-len", type=int, default=None,
                       help="Shared prefix tokens (default: 2048 GPU, 512 CPU).")
    group.add_argument("--suffix-len", type=int, default=None,
                       help="Unique suffix tokens per request (default: 128 GPU, 32 CPU).")
    _output_len(group)
    add_common_arguments(parser)


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("spec workload (speculative decoding on vs off)")
    group.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                       help="Requests submitted together (default: 1 8).")
    group.add_argument("--workloads", nargs="+", choices=("repetitive", "open"),
                       default=["repetitive", "open"], help="Which prompt sets to run.")
    group.add_argument("--output-len", "--max-tokens", dest="output_len", type=int, default=128,
                       help="Output tokens per request, EOS ignored.")
    group.add_argument("--rounds", type=int, default=3,
                       help="Off / on pairs per workload and batch size, alternating; the ratios "
                       "reported are the median round's (default 3).")
    add_common_arguments(parser)
