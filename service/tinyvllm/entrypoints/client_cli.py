"""`tinyvllm client`: stream a completion from a running server to the terminal."""

from __future__ import annotations

import argparse
import asyncio
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "client", help="Stream a completion from a tinyvllm server.", description=__doc__)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="The prompt (a user message with --chat).")
    parser.add_argument("--host", default="127.0.0.1", help="Server address.")
    parser.add_argument("--port", type=int, default=50051, help="Server gRPC port.")
    parser.add_argument("--chat", action="store_true",
                        help="Send the prompt as a user message through the chat template.")
    parser.add_argument("--system", default=None, help="System message (with --chat).")
    parser.add_argument("--timeout", type=float, default=None, help="Deadline in seconds.")
    parser.add_argument("--usage", action="store_true",
                        help="Print finish reason, token counts and timings to stderr.")
    s = parser.add_argument_group("sampling (unset: server defaults)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="Most tokens to generate (server default: up to the context length).")
    s.add_argument("--temperature", type=float, default=None, help="0 is greedy.")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--frequency-penalty", type=float, default=None)
    s.add_argument("--min-tokens", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    s.add_argument("--ignore-eos", action="store_true")


_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "min_tokens")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_stream(args))


async def _stream(args: argparse.Namespace) -> int:
    import grpc.aio

    from tinyvllm.client import FINISH_REASONS, AsyncClient

    prompt = args.prompt
    if args.chat:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
    sampling = {k: getattr(args, k) for k in _SAMPLING}
    async with AsyncClient(f"{args.host}:{args.port}") as client:
        try:
            async for r in client.generate(prompt, timeout=args.timeout, stop=args.stop or [],
                                           ignore_eos=args.ignore_eos, **sampling):
                sys.stdout.write(r.text)
                sys.stdout.flush()
                if r.finish_reason and args.usage:
                    print(f"\n[{FINISH_REASONS.get(r.finish_reason)}] prompt_tokens="
                          f"{r.usage.prompt_tokens} completion_tokens={r.usage.completion_tokens}"
                          f" cached={r.usage.cached_prompt_tokens} ttft={r.timing.ttft_s:.3f}s"
                          f" e2e={r.timing.e2e_s:.3f}s", file=sys.stderr)
        except grpc.aio.AioRpcError as e:
            print(f"\ntinyvllm client: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0
