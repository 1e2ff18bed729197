"""`tinyvllm serve`: the gRPC server (Generation, health, reflection) plus /metrics and /health,
and with --http-port the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from tinyvllm.config import (ServerConfig, add_config_arguments, add_engine_arguments,
                             config_from_args, engine_config_from_args)

EPILOG = """\
examples:
  tinyvllm serve                                   # bundled SmolLM2-135M-Instruct on CPU
  tinyvllm serve --port 50051 --metrics-port 8000 --max-num-seqs 64
  grpcurl -plaintext 127.0.0.1:50051 list
  grpcurl -plaintext -d '{"text": "Hello", "sampling": {"max_tokens": 32}}' \\
      127.0.0.1:50051 tinyvllm.v1.Generation/Generate
  tinyvllm client --port 50051 "Hello"
  tinyvllm serve --http-port 8080                  # + OpenAI-compatible HTTP API
  curl 127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \
      -d '{"prompt": "Hello", "max_tokens": 16}'
  tinyvllm serve --tls-cert-file s.pem --tls-key-file s.key --api-key-file keys.txt
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="Serve a model over gRPC.", description=__doc__,
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ServerConfig)
    add_engine_arguments(parser)
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"), help="Logging verbosity.")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_config = config_from_args(args, ServerConfig)
    engine_config = engine_config_from_args(args)
    from tinyvllm.server.app import serve  # grpc and zmq only when serving

    return _run_event_loop(serve(server_config, engine_config))


def _run_event_loop(main) -> int:
    try:
        import uvloop
    except ImportError:  # not on Windows
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def main(argv=None) -> int:
    """`python -m tinyvllm.entrypoints.serve ...`, the same as `tinyvllm serve ...`."""
    parser = argparse.ArgumentParser(prog="tinyvllm serve", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
