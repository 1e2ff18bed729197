"""`tinyvllm generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from tinyvllm.config import add_engine_arguments, engine_config_from_args
from tinyvllm.sampling_params import SamplingParams


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="Most tokens to generate (default: up to the context length).")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables.")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="Per-request sampling seed (--seed is the engine's).")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="Top logprobs per token.")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens, stop=args.stop,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="Generate completions offline.",
                              description="Generate completions for prompts given as arguments "
                              "or one per line on stdin.")
    p.add_argument("prompts", nargs="*", help="Prompts (default: read lines from stdin).")
    p.add_argument("--chat", action="store_true", help="Treat each prompt as a user message "
                   "and apply the model's chat template.")
    p.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tinyvllm.entrypoints.llm import LLM

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("tinyvllm generate: no prompts given", file=sys.stderr)
        return 2
    try:
        params = sampling_params_from_args(args)
    except ValueError as e:
        print(f"tinyvllm generate: {e}", file=sys.stderr)
        return 2
    config = engine_config_from_args(args)
    try:
        llm = LLM.from_config(config)
    except (FileNotFoundError, ValueError, NotImplementedError) as e:  # model absent or refused
        print(f"tinyvllm generate: {e}", file=sys.stderr)
        return 1
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            print(f"--- {prompt!r}\n{c.text}\n[{c.finish_reason}, {len(c.token_ids)} tokens]")
    return 0
