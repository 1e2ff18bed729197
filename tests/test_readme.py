"""Every example of README.md runs: each fenced block, picked up by its language tag.

* `bash` blocks: every command (a `\\` continuation or a quote spanning lines is one command;
  `&&` chains are split) runs as a process, and must exit 0 with output. The README's first
  `tinyvllm serve` is started as the server every later example talks to; ports are mapped to
  free ones on 127.0.0.1 in every block alike (the README's 50051 is one port here, wherever it
  appears). `grpcurl` runs when installed; otherwise its request goes through the equivalent
  Python call (reflection, or the method's protobuf from JSON, as grpcurl does).
* `python` blocks: each runs as a script, with the same port mapping, and must exit 0.
* Any other language tag fails the test until it gets a runner or a line in `SKIPPED_TAGS`.

Small sizes: engine commands get `SMALL_FLAGS` appended (argparse keeps the last value of a flag),
so that each example runs in seconds on a CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
HOST = "127.0.0.1"
COMMAND_TIMEOUT_S = 600

# Commands that cannot run here, by their leading words, each with the reason.
SKIPPED_COMMANDS = {
    # The environment these tests run in was made by the Quick start's install commands
    # (.ci/run runs the second Quick-start command verbatim).
    ("pip", "install"): "installs packages: this test environment was made by it",
    ("python", "-m", "pytest"): "runs the test suite: that is this run",
    ("helm",): "needs a Kubernetes cluster (the chart is checked by tests/helm)",
    ("kubectl",): "needs a Kubernetes cluster",
    ("docker",): "needs a container runtime",
}
# Language tags of blocks that are not programs, with the reason.
SKIPPED_TAGS = {
    "text": "output shown, not a program",
    "yaml": "a configuration excerpt (Helm values are checked by tests/helm)",
    "json": "a payload or record shown, not a program",
    "proto": "an API excerpt (the API itself is built from proto/)",
}

# Appended to engine commands so that they finish in seconds on a CPU.
SMALL_FLAGS = {
    ("tinyvllm", "serve"): ["--max-model-len", "128", "--kv-cache-memory-gb", "0.25"],
    ("tinyvllm", "generate"): ["--max-model-len", "128", "--kv-cache-memory-gb", "0.1"],
    ("tinyvllm", "bench", "latency"): ["--input-len", "8", "--output-len", "4", "--num-iters",
                                       "1", "--no-baseline"],
    ("tinyvllm", "bench", "throughput"): ["--num-prompts", "4", "--input-len", "8",
                                          "--output-len", "4", "--no-baseline"],
    ("tinyvllm", "bench", "prefix"): ["--num-prompts", "2", "--prefix-len", "32",
                                      "--suffix-len", "4", "--output-len", "2", "--no-baseline"],
    ("tinyvllm", "bench", "spec"): ["--max-tokens", "6", "--batch-sizes", "1", "--workloads",
                                    "repetitive", "--no-baseline", "--rounds", "1"],
    ("tinyvllm", "bench", "serve"): ["--request-rate", "inf", "--num-prompts", "2",
                                     "--input-len", "8", "--output-len", "4"],
    ("tinyvllm", "bench", "kernels"): ["--quick"],
    ("tinyvllm", "eval", "perplexity"): ["--window", "16", "--max-model-len", "128",
                                         "--kv-cache-memory-gb", "0.1"],
}

EXAMPLE_FILES = {"text.txt": "The quick brown fox jumps over the lazy dog. " * 8}
"""Input files the README's commands name, written into their working directory."""


@dataclass
class Example:
    kind: str  # "bash" or "python"
    text: str  # one command, or a whole python block
    line: int  # where it starts in README.md

    @property
    def id(self) -> str:
        first = self.text.strip().splitlines()[0]
        return f"L{self.line}:{first[:60]}"


# --- reading the README -------------------------------------------------------------------------

def fenced_blocks(markdown: str) -> list[tuple[str, str, int]]:
    """(language tag, code, line of the first code line) of every ``` block."""
    blocks, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        match = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if match:
            start, end = i + 1, i + 1
            while not re.match(r"^\s*```\s*$", lines[end]):
                end += 1
            blocks.append((match.group(2), "\n".join(lines[start:end]), start + 1))
            i = end
        i += 1
    return blocks


def shell_commands(code: str) -> list[tuple[str, int]]:
    """Commands of a shell block with their line offsets: continuation lines joined, comments
    dropped, a quoted string spanning lines kept whole."""
    commands, pending, first = [], "", 0
    for offset, line in enumerate(code.splitlines()):
        if not pending:
            first = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if words:
            commands.append((pending.strip(), first))
        pending = ""
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return commands


def examples() -> list[Example]:
    found = []
    for tag, code, line in fenced_blocks(README.read_text()):
        if tag in ("bash", "sh", "shell"):
            for command, offset in shell_commands(code):
                for part in split_and(command):
                    found.append(Example("bash", part, line + offset))
        elif tag == "python":
            found.append(Example("python", code, line))
        elif tag not in SKIPPED_TAGS:
            found.append(Example(tag or "untagged", code, line))
    return found


def split_and(command: str) -> list[str]:
    """`a && b` -> ["a", "b"], each re-quoted for shlex."""
    words = shlex.split(command, comments=True)
    parts, current = [], []
    for word in words + ["&&"]:
        if word == "&&":
            parts.append(shlex.join(current))
            current = []
        else:
            current.append(word)
    return parts


# --- ports -------------------------------------------------------------------------------------

PORT_PATTERN = re.compile(r"(?:(?<=127\.0\.0\.1:)|(?<=localhost:)|(?<=port )|(?<=port=))(\d{4,5})"
                          r"\b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class PortMap:
    """The README's ports -> free local ports, the same mapping for every example."""

    def __init__(self) -> None:
        self.ports: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        def replace(match: re.Match) -> str:
            return self.ports.setdefault(match.group(1), str(free_port()))
        return PORT_PATTERN.sub(replace, text)


# --- running -----------------------------------------------------------------------------------

def _starts_with(words: list[str], prefix: tuple[str, ...]) -> bool:
    return tuple(words[:len(prefix)]) == prefix


def skip_reason(words: list[str]) -> Optional[str]:
    for prefix, reason in SKIPPED_COMMANDS.items():
        if _starts_with(words, prefix):
            return reason
    if _starts_with(words, ("tinyvllm", "bench", "kernels")) and words[3:5] != ["--only", "cpu"]:
        import torch
        if not torch.cuda.is_available():
            return "bench kernels times CUDA kernels: needs a GPU"
    return None


def small(words: list[str], tmp_path: Path) -> list[str]:
    """`words` with SMALL_FLAGS (longest matching prefix) and a temporary output file."""
    prefix = max((p for p in SMALL_FLAGS if _starts_with(words, p)), key=len, default=None)
    if prefix is None:
        return words
    extra = list(SMALL_FLAGS[prefix])
    if prefix[:2] == ("tinyvllm", "bench"):
        extra += ["--out", str(tmp_path / f"{prefix[-1]}.json")]
    return words + extra


def env() -> dict[str, str]:
    return {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Server:
    proc: subprocess.Popen
    target: str
    log: Path

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_serve(words: list[str], log: Path) -> Server:
    from tinyvllm.client import AsyncClient

    port = words[words.index("--port") + 1] if "--port" in words else "50051"
    with open(log, "wb") as out:
        proc = subprocess.Popen(words, stdout=out, stderr=subprocess.STDOUT, env=env())
    server = Server(proc, f"{HOST}:{port}", log)

    async def wait() -> None:
        async with AsyncClient(server.target) as client:
            await client.wait_until_serving(timeout=300)

    try:
        asyncio.run(wait())
    except TimeoutError:
        server.stop()
        pytest.fail(f"{shlex.join(words)} not SERVING:\n{log.read_text()[-3000:]}")
    return server


ALL = examples()


@pytest.fixture(scope="module")
def ports() -> PortMap:
    return PortMap()


@pytest.fixture(scope="module")
def server(ports, tmp_path_factory, smollm2_path):
    """The README's first `tinyvllm serve`, small, on the mapped ports."""
    serve = next((shlex.split(ports(e.text)) for e in ALL if e.kind == "bash"
                  and _starts_with(shlex.split(e.text), ("tinyvllm", "serve"))), None)
    assert serve, "the README has no `tinyvllm serve` command"
    srv = start_serve(small(serve, tmp_path_factory.mktemp("x")),
                      tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


def test_readme_has_examples():
    kinds = {e.kind for e in ALL}
    assert {"bash", "python"} <= kinds and len(ALL) > 10


@pytest.mark.slow
@pytest.mark.parametrize("example", ALL, ids=lambda e: e.id)
def test_example_runs(example: Example, server, ports, tmp_path):
    if example.kind == "python":
        result = subprocess.run([sys.executable, "-c", ports(example.text)], capture_output=True,
                                text=True, timeout=COMMAND_TIMEOUT_S, env=env(), cwd=tmp_path)
        assert result.returncode == 0, f"README line {example.line}:\n{result.stderr[-3000:]}"
        assert result.stdout.strip()
        return
    assert example.kind == "bash", (f"README line {example.line}: a ```{example.kind} block has "
                                    "no runner; add one here or its tag to SKIPPED_TAGS")
    words = shlex.split(ports(example.text))
    reason = skip_reason(words)
    if reason:
        pytest.skip(f"{words[0]}: {reason}")
    if _starts_with(words, ("tinyvllm", "serve")) and server.proc.args == small(words, tmp_path):
        return  # the shared server: it started and serves
    if _starts_with(words, ("tinyvllm", "serve")):
        other = start_serve(small(words, tmp_path), tmp_path / "server.log")
        assert other.stop() == 0
        return
    if _starts_with(words, ("tinyvllm", "bench", "serve")):
        words += ["--target", server.target]  # the README's server, not one of its own
    for name, text in EXAMPLE_FILES.items():
        if name in words:
            (tmp_path / name).write_text(text)
    if words[0] == "grpcurl" and shutil.which("grpcurl") is None:
        output = grpcurl_in_python(words[1:])
    else:
        assert shutil.which(words[0]), f"README line {example.line}: {words[0]} is not installed"
        result = subprocess.run(small(words, tmp_path), capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT_S, env=env(), cwd=tmp_path)
        assert result.returncode == 0, (f"README line {example.line}: {shlex.join(words)}\n"
                                        f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
        output = result.stdout
    assert output.strip(), f"README line {example.line}: no output"


# --- grpcurl, when it is not installed -----------------------------------------------------------

def grpcurl_in_python(args: list[str]) -> str:
    """What `grpcurl [-plaintext] [-d JSON] TARGET (list | describe SYMBOL | SERVICE/METHOD)`
    does, through grpcio: reflection for list/describe, JSON -> protobuf for a call."""
    import grpc

    data, rest = "{}", []
    it = iter(args)
    for arg in it:
        if arg == "-d":
            data = next(it)
        elif arg != "-plaintext":
            assert not arg.startswith("-"), f"grpcurl flag {arg} has no Python equivalent here"
            rest.append(arg)
    target, verb, *more = rest
    with grpc.insecure_channel(target) as channel:
        if verb in ("list", "describe"):
            return _reflection(channel, verb, more)
        return _call(channel, verb, data)


def _reflection(channel, verb: str, more: list[str]) -> str:
    from grpc_reflection.v1alpha import reflection_pb2 as rpb
    from grpc_reflection.v1alpha import reflection_pb2_grpc as rgrpc

    stub = rgrpc.ServerReflectionStub(channel)
    request = (rpb.ServerReflectionRequest(list_services="") if verb == "list" else
               rpb.ServerReflectionRequest(file_containing_symbol=more[0]))
    [response] = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
    assert not response.HasField("error_response"), response.error_response.error_message
    if verb == "list":
        return "\n".join(s.name for s in response.list_services_response.service)
    files = response.file_descriptor_response.file_descriptor_proto
    assert files, f"no descriptor for {more[0]}"
    return f"{more[0]}: {len(files)} descriptor file(s)"


def _call(channel, method_path: str, data: str) -> str:
    from google.protobuf import descriptor_pool, json_format, symbol_database
    from grpc_health.v1 import health_pb2  # noqa: F401 (registers grpc.health.v1)

    from tinyvllm.v1 import generation_pb2  # noqa: F401 (registers tinyvllm.v1)

    service_name, method_name = method_path.split("/")
    service = descriptor_pool.Default().FindServiceByName(service_name)
    method = service.methods_by_name[method_name]
    db = symbol_database.Default()
    request_cls = db.GetSymbol(method.input_type.full_name)
    response_cls = db.GetSymbol(method.output_type.full_name)
    request = json_format.Parse(data, request_cls())
    path = f"/{service_name}/{method_name}"
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    call = kind(path, request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString)
    responses = call(request, timeout=300)
    if not method.server_streaming:
        responses = [responses]
    return "\n".join(json.dumps(json_format.MessageToDict(r)) for r in responses)
