"""`tinyvllm serve` with the model-free FakeEngineCore: the real servers (gRPC, HTTP API, metrics,
TLS, auth) in a process that starts in seconds. `python -m tests.server.fake_serve <serve flags>`.
"""

from __future__ import annotations

import argparse
import sys

from tinyvllm.entrypoints import serve

FAKE_ENGINE = "tests.server.fake_engine:FakeEngineCore"


def main() -> int:
    parser = argparse.ArgumentParser(prog="fake_serve")
    serve.add_arguments(parser)
    args = parser.parse_args()
    import logging

    from tinyvllm.config import ServerConfig, config_from_args, engine_config_from_args
    from tinyvllm.server.app import Server

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = Server(config_from_args(args, ServerConfig), engine_config_from_args(args),
                    engine_class=FAKE_ENGINE)
    return serve._run_event_loop(server.run())


if __name__ == "__main__":
    sys.exit(main())
