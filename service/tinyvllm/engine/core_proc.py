"""The engine core in its own process, talking to the frontend over ZeroMQ.

```
frontend (asyncio)                                    engine-core process (this module)
  PUSH  ipc://<dir>/input   ── AddRequests / AbortRequests / Shutdown ──▶  PULL
  PULL  ipc://<dir>/output  ◀── Ready, then one StepOutputs per step ───  PUSH
                                (EngineFailed once, then exit 1)
```

Messages are msgspec structs tagged by type. The loop is busy while there is work: it drains the
input socket without blocking, runs one `EngineCore.step()`, and sends ONE message carrying every
request's outputs plus the engine stats. When idle it blocks on input, waking now and then.

No send blocks for good: outputs go out with NOBLOCK, and while the frontend does not take them
(its queue is full) the loop waits in short polls that also check for the parent's death and
SIGTERM (`parent_guard`), so a dead frontend never leaves an engine hanging in a send.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time
import traceback
from typing import Any, Optional, Union

import msgspec
import zmq

from tinyvllm.config import EngineConfig, RuntimeInfo
from tinyvllm.engine.parent_guard import EngineExit, ParentGuard
from tinyvllm.engine.stats import EngineStats
from tinyvllm.errors import InvalidRequestError
from tinyvllm.scheduling.request import EngineCoreOutput, EngineCoreRequest, FinishReason

DEFAULT_ENGINE_CLASS = "tinyvllm.engine.engine_core:EngineCore"

IDLE_POLL_MS = 500
"""How often an idle engine wakes to check that its parent is still alive."""

SEND_POLL_MS = 100
"""While the frontend takes no output, how often the engine checks whether it should exit."""

FAILURE_LINGER_MS = 2000
"""How long the engine waits for its last message (Ready / EngineFailed) to leave on exit."""


# --- wire messages ----------------------------------------------------------------------------

class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


EngineInput = Union[AddRequests, AbortRequests, Shutdown]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    runtime_info: RuntimeInfo
    pid: int


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one engine step produced.

    `stats` are the engine's numbers after it, and `step_start_time` is `time.monotonic()` when
    the step began (the clock is system-wide).
    """

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    step_start_time: float


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    error: str


EngineOutput = Union[Ready, StepOutputs, EngineFailed]


def ipc_addresses(directory: str) -> tuple[str, str]:
    """(input address, output address) of the sockets in `directory`."""
    return f"ipc://{directory}/input", f"ipc://{directory}/output"


# --- the process --------------------------------------------------------------------------------

def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    engine_class: str = DEFAULT_ENGINE_CLASS, *, parent_pid: Optional[int] = None,
                    ipc_dir: Optional[str] = None, sigterm_grace_s: float = 60.0) -> None:
    """Entry point of the engine process (multiprocessing `spawn` target).

    Exits 0 on Shutdown, SIGTERM or when the parent is gone (`parent_guard`), 1 after sending
    EngineFailed.
    """
    guard = ParentGuard(parent_pid or os.getppid(), ipc_dir, sigterm_grace_s)
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    outputs = ctx.socket(zmq.PUSH)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        guard.install()
        inputs.connect(input_addr)
        outputs.connect(output_addr)
        core = _load_engine(engine_class)(config)
        # What start-up made (model, torch's and the tokenizer's objects) lives as long as the
        # process: out of the cyclic collector's sight, a full collection no longer walks it
        # between steps (vLLM's freeze of the engine core's heap).
        gc.collect()
        gc.freeze()
        send_or_exit(outputs, encoder.encode(Ready(runtime_info=core.runtime_info,
                                                   pid=os.getpid())), guard)
        guard.serving = True
        EngineCoreLoop(core, inputs, outputs, encoder, guard).run()
        guard.exiting()
        core.shutdown()
    except EngineExit as e:
        print(f"tinyvllm engine core exiting: {e}", file=sys.stderr, flush=True)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the frontend
        code = 1
        detail = "".join(traceback.format_exception(e))
        print(f"tinyvllm engine core failed:\n{detail}", file=sys.stderr, flush=True)
        try:
            outputs.send(encoder.encode(EngineFailed(error=f"{type(e).__name__}: {e}")),
                         zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # nobody is reading: the frontend sees the exit code instead
    finally:
        guard.exiting()
        orphaned = guard.parent_gone()
        inputs.close(linger=0)
        outputs.close(linger=0 if orphaned else FAILURE_LINGER_MS)
        ctx.term()
        guard.cleanup_if_orphaned()
    sys.exit(code)


def send_or_exit(socket: zmq.Socket, data: bytes, guard: ParentGuard) -> None:
    """Send without ever blocking for good: wait while the peer's queue is full, unless the
    engine should exit (parent gone, SIGTERM grace over).

    Raises:
        EngineExit: the engine should exit before the message could go out.
    """
    while True:
        try:
            socket.send(data, zmq.NOBLOCK)
            return
        except zmq.Again:
            if guard.should_exit():
                raise EngineExit("output not taken and the engine should exit") from None
            socket.poll(SEND_POLL_MS, zmq.POLLOUT)


def _load_engine(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class EngineCoreLoop:
    """Busy loop around one `EngineCore`: drain inputs, step, send one message per step."""

    def __init__(self, core: Any, inputs: zmq.Socket, outputs: zmq.Socket,
                 encoder: msgspec.msgpack.Encoder, guard: ParentGuard):
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.encoder = encoder
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.guard = guard
        self.shutdown_requested = False
        # Outputs produced outside a step (requests the core refused); sent with the next message.
        self.pending_outputs: list[EngineCoreOutput] = []

    def run(self) -> None:
        while not self.shutdown_requested:
            if self.guard.should_exit():
                return  # the frontend is gone, or a SIGTERM's grace ran out
            busy = self.core.has_unfinished_requests()
            handled = self._drain_inputs(timeout_ms=0 if busy else IDLE_POLL_MS)
            if self.shutdown_requested:
                return
            if self.core.has_unfinished_requests():
                self._step()
            elif handled:
                # Idle after aborts or refusals: report them and the freed blocks once.
                self._send(time.monotonic())

    def _drain_inputs(self, timeout_ms: int) -> bool:
        """Handle every queued input, waiting up to `timeout_ms` for the first one."""
        if not self.inputs.poll(timeout_ms):
            return False
        while not self.shutdown_requested:
            try:
                raw = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(self.decoder.decode(raw))
        return True

    def _handle(self, msg: EngineInput) -> None:
        if isinstance(msg, AddRequests):
            for req in msg.requests:
                self._add(req)
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids)
        else:
            self.shutdown_requested = True

    def _add(self, req: EngineCoreRequest) -> None:
        try:
            self.core.add_request(req)
        except InvalidRequestError as e:
            self.pending_outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[],
                finish_reason=FinishReason.ERROR, error=str(e)))

    def _step(self) -> None:
        start = time.monotonic()
        step_outputs = self.core.step()
        self._send(start, step_outputs)

    def _send(self, start: float, step_outputs: Optional[list[EngineCoreOutput]] = None) -> None:
        outputs = self.pending_outputs + list(step_outputs or [])
        self.pending_outputs = []
        stats: EngineStats = self.core.get_stats()
        if step_outputs is None:  # no step ran: nothing was scheduled
            stats = msgspec.structs.replace(stats, num_scheduled_tokens=0)
        send_or_exit(self.outputs, self.encoder.encode(
            StepOutputs(outputs=outputs, stats=stats, step_start_time=start)), self.guard)
