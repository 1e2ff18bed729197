"""`tinyvllm serve`: the gRPC server (Generation, health, reflection) plus /metrics and /health,
and with --http-port the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from tinyvllm.config import (ServerConfig, add_config_arguments, add_engine_arguments,
                             config_from_args, engine_config_from_args)
from tinyvllm.server.logs import LOG_FORMATS, configure_logging

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
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="Log lines as text, or as one JSON object per line (the access "
                        "log's and stats' values as keys).")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def exit_zero_on_sigterm() -> None:
    """Until the server installs its own handlers, SIGTERM means a clean exit (code 0)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def run(args: argparse.Namespace) -> int:
    exit_zero_on_sigterm()
    configure_logging(args.log_level, args.log_format)
    server_config = config_from_args(args, ServerConfig)
    engine_config = engine_config_from_args(args)
    try:  # before any port opens: a missing model (or Hub download) is found here, once
        resolve_model(engine_config.model.model)
    except (FileNotFoundError, ValueError) as e:
        print(f"tinyvllm serve: {e}", file=sys.stderr)
        return 1
    from tinyvllm.server.app import serve  # grpc and zmq only when serving

    return _run_event_loop(serve(server_config, engine_config))


def resolve_model(model):
    """The model's files (downloading a Hub name); a synthetic model name has none."""
    from tinyvllm.model_files import SYNTHETIC_MODEL_VOCAB_SIZES, resolve_model_path

    return None if model in SYNTHETIC_MODEL_VOCAB_SIZES else resolve_model_path(model)


def _run_event_loop(main) -> int:
    try:
        import uvloop
    except ImportError:  # not on Windows
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def main(argv=None) -> int:
    """`python -m tinyvllm.entrypoints.serve ...`, the same as `tinyvllm serve ...`."""
    exit_zero_on_sigterm()
    parser = argparse.ArgumentParser(prog="tinyvllm serve", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
