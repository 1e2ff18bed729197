"""`tinyvllm` command line: generate, serve, client, bench, eval.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its parser and
sets `func` to the function that runs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS = ("generate", "serve", "client", "bench", "eval")
_MODULES = {
    "generate": "tinyvllm.entrypoints.generate",
    "serve": "tinyvllm.entrypoints.serve",
    "client": "tinyvllm.entrypoints.client_cli",
    "bench": "tinyvllm.bench.cli",
    "eval": "tinyvllm.entrypoints.eval_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyvllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(_MODULES[name])
        except ModuleNotFoundError as e:
            if e.name != _MODULES[name]:
                raise
            continue  # subcommand not present in this build
        module.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
