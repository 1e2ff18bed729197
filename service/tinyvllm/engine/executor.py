"""Executors: where the model runs for the engine core.

The engine core schedules a step (`SchedulerOutput`, plain data) and hands it to its executor;
`execute_async` returns a handle whose `result()` is the step's sampled tokens. Two executors:

- `UniProcExecutor`: the model runner in the engine's own process (offline `LLM`, tests, one
  device). The message is passed as the object itself.
- `MultiprocExecutor`: one worker process per tensor-parallel rank, each owning one device. Each
  step's message is msgspec-encoded once and published to every worker over one ZeroMQ PUB
  socket; rank 0 sends the sampled tokens back (all ranks sample the same tokens: rank 0's are
  broadcast inside the step). With async scheduling the engine publishes step N + 1 before it
  waits for N: a worker launches steps on its main thread and reads their results on a second
  thread, so the next step is queued on the device while the previous one computes.

```
engine core ──PUB (step N: SchedulerOutput)──▶ worker rank 0 ─┐ torch.distributed
                                            ├─▶ worker rank 1 ─┤ (NCCL / gloo): all-reduce,
                                            └─▶ ...            ┘ all-gather, broadcast
engine core ◀──PUSH (step N: sampled tokens)── worker rank 0
```

A worker that dies, or fails, takes the engine down with an error naming the rank, as the
engine process does to the frontend.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import traceback
from typing import Any, Optional

import msgspec
import zmq

from tinyvllm.config import EngineConfig
from tinyvllm.scheduling.output import (DraftTokens, PromptLogprobs, SampledTokens,
                                        SchedulerOutput)

logger = logging.getLogger(__name__)

_STEP, _SYNC, _QUIT = b"s", b"y", b"q"  # engine -> workers
_READY, _OUTPUT, _ACK, _ERROR = b"r", b"o", b"a", b"e"  # workers -> engine
_POLL_MS = 200  # how often a waiting engine checks that its workers live
_SYNC_INTERVAL_MS = 20


class WorkerInfo(msgspec.Struct, array_like=True):
    """What the engine learns from rank 0 once the model and KV cache are ready (every rank has
    the same number of KV blocks: the smallest any rank could fit)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    model_name: str
    device: str
    dtype: str
    max_num_seqs: int  # the step sizes the runner was built for (unset ones chosen by device)
    max_num_batched_tokens: int


class _Ready(msgspec.Struct, array_like=True):
    rank: int
    info: WorkerInfo


class _Output(msgspec.Struct, array_like=True, omit_defaults=True):
    step_id: int
    sampled: SampledTokens
    prompt_logprobs: PromptLogprobs = {}
    draft_token_ids: DraftTokens = {}


class _Error(msgspec.Struct, array_like=True):
    rank: int
    message: str


def _runner_info(runner: Any) -> WorkerInfo:
    loaded = runner.loaded
    return WorkerInfo(
        num_blocks=runner.num_blocks, block_size=runner.block_size,
        max_model_len=runner.max_model_len, vocab_size=loaded.arch.vocab_size,
        eos_token_ids=list(loaded.tokenizer.eos_token_ids), model_name=loaded.name,
        device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
        max_num_seqs=runner.max_num_seqs, max_num_batched_tokens=runner.max_num_tokens)


class UniProcExecutor:
    """The model runner in this process; `runner` may be given (tests, benchmarks that share
    one model between engines)."""

    def __init__(self, config: EngineConfig, runner: Any = None):
        if runner is None:
            from tinyvllm.worker.model_runner import ModelRunner
            runner = ModelRunner(config)
        self.runner = runner
        self.info = _runner_info(runner)
        self.tokenizer = runner.loaded.tokenizer
        self.device_type = runner.device.type

    def execute_async(self, out: SchedulerOutput):
        return self.runner.execute_async(out)

    def shutdown(self) -> None:
        pass


class _RemoteStep:
    """A step published to the workers; `result()` waits for rank 0's answer (and sets
    `prompt_logprobs` and `draft_token_ids`)."""

    __slots__ = ("_executor", "_step_id", "_result", "prompt_logprobs", "draft_token_ids")

    def __init__(self, executor: "MultiprocExecutor", step_id: Optional[int]):
        self._executor = executor
        self._step_id = step_id
        self._result: Optional[SampledTokens] = None if step_id is not None else {}
        self.prompt_logprobs: PromptLogprobs = {}
        self.draft_token_ids: DraftTokens = {}

    def result(self) -> SampledTokens:
        if self._result is None:
            output = self._executor._wait_output(self._step_id)
            self._result, self.prompt_logprobs = output.sampled, output.prompt_logprobs
            self.draft_token_ids = output.draft_token_ids
        return self._result


class MultiprocExecutor:
    """`tensor_parallel_size` worker processes (spawned), driven by messages."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0):
        import multiprocessing

        self.world_size = config.parallel.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="tinyvllm-workers-")
        steps_addr = f"ipc://{self._dir}/steps"
        results_addr = f"ipc://{self._dir}/results"
        self._ctx = zmq.Context()
        self._steps = self._ctx.socket(zmq.PUB)
        self._steps.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self._steps.bind(steps_addr)
        self._results = self._ctx.socket(zmq.PULL)
        self._results.bind(results_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(_Output)
        dist_init = f"tcp://127.0.0.1:{_free_port()}"
        mp = multiprocessing.get_context("spawn")
        me = multiprocessing.current_process()
        if me.daemon:
            # The engine process is daemonic (it dies with the server); multiprocessing refuses
            # children of a daemonic process. Its workers are daemonic themselves and die with it.
            me.daemon = False
        self._procs = [mp.Process(target=run_worker, name=f"tinyvllm-worker-{rank}",
                                  args=(config, rank, self.world_size, steps_addr, results_addr,
                                        dist_init, os.getpid()), daemon=True)
                       for rank in range(self.world_size)]
        self._closed = False
        try:
            for p in self._procs:
                p.start()
            self.info = self._wait_ready(start_timeout_s)
            self._sync()
        except BaseException:
            self.shutdown()
            raise
        from tinyvllm.tokenization import load_tokenizer
        self.tokenizer = load_tokenizer(config.model.model)
        self.device_type = self.info.device.split(":")[0]

    # --- start-up -------------------------------------------------------------------------------

    def _recv(self, timeout_ms: int) -> Optional[tuple[bytes, bytes]]:
        """One message from the workers, or None after timeout_ms. Raises when a worker failed
        or died."""
        if self._results.poll(timeout_ms):
            kind, payload = self._results.recv_multipart()
            if kind == _ERROR:
                err = msgspec.msgpack.decode(payload, type=_Error)
                raise RuntimeError(f"worker rank {err.rank} failed: {err.message}")
            return kind, payload
        self._check_alive()
        return None

    def _check_alive(self) -> None:
        for rank, p in enumerate(self._procs):
            if not p.is_alive():
                raise RuntimeError(f"worker rank {rank} (pid {p.pid}) exited with code "
                                   f"{p.exitcode}")

    def _wait_ready(self, timeout_s: float) -> WorkerInfo:
        import time
        deadline = time.monotonic() + timeout_s
        infos: dict[int, WorkerInfo] = {}
        while len(infos) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready after {timeout_s:.0f} s "
                                   f"(ready ranks: {sorted(infos)})")
            msg = self._recv(_POLL_MS)
            if msg is not None and msg[0] == _READY:
                ready = msgspec.msgpack.decode(msg[1], type=_Ready)
                infos[ready.rank] = ready.info
        return infos[0]

    def _sync(self) -> None:
        """Publish until every worker has answered: a SUB socket receives only what is sent
        after its subscription has reached the publisher."""
        acked: set[int] = set()
        while len(acked) < self.world_size:
            self._steps.send_multipart([_SYNC, b""])
            msg = self._recv(_SYNC_INTERVAL_MS)
            while msg is not None:
                if msg[0] == _ACK:
                    acked.add(int(msg[1]))
                msg = self._recv(0) if self._results.poll(0) else None

    # --- steps ----------------------------------------------------------------------------------

    def execute_async(self, out: SchedulerOutput) -> _RemoteStep:
        self._steps.send_multipart([_STEP, self._encoder.encode(out)], copy=False)
        return _RemoteStep(self, None if out.is_empty else out.step_id)

    def _wait_output(self, step_id: int) -> _Output:
        while True:
            msg = self._recv(_POLL_MS)
            if msg is None or msg[0] != _OUTPUT:
                continue  # a late sync answer
            output = self._output_decoder.decode(msg[1])
            if output.step_id == step_id:
                return output
            if output.step_id > step_id:
                raise RuntimeError(f"worker answered step {output.step_id} before step {step_id}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._steps.send_multipart([_QUIT, b""], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        for p in self._procs:
            if p.pid is not None:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        self._steps.close(linger=0)
        self._results.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def make_executor(config: EngineConfig):
    if config.parallel.executor_backend == "mp":
        return MultiprocExecutor(config)
    return UniProcExecutor(config)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the worker process ---------------------------------------------------------------------------

def run_worker(config: EngineConfig, rank: int, world_size: int, steps_addr: str,
               results_addr: str, dist_init: str, parent_pid: int) -> None:
    """Entry point of a worker process (spawn target): load this rank's shard of the model, say
    Ready, then run every published step until told to quit or the engine is gone."""
    from tinyvllm.engine.parent_guard import _set_parent_death_signal

    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        sys.exit(0)  # the engine died before the signal was armed
    ctx = zmq.Context()
    steps = ctx.socket(zmq.SUB)
    steps.setsockopt(zmq.RCVHWM, 0)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    steps.connect(steps_addr)
    results = ctx.socket(zmq.PUSH)
    results.connect(results_addr)
    lock = threading.Lock()  # zmq sockets are not thread-safe: the result thread shares `results`
    encoder = msgspec.msgpack.Encoder()

    def send(kind: bytes, payload: bytes) -> None:
        with lock:
            results.send_multipart([kind, payload])

    code = 0
    try:
        runner = _start_runner(config, rank, world_size, dist_init)
        send(_READY, encoder.encode(_Ready(rank, _runner_info(runner))))
        _WorkerLoop(runner, rank, steps, send, encoder).run()
    except BaseException as e:  # noqa: BLE001 - the engine must hear of every failure
        code = 1
        detail = "".join(traceback.format_exception(e))
        print(f"tinyvllm worker rank {rank} failed:\n{detail}", file=sys.stderr, flush=True)
        try:
            send(_ERROR, encoder.encode(_Error(rank, f"{type(e).__name__}: {e}")))
        except zmq.ZMQError:
            pass
    finally:
        steps.close(linger=0)
        results.close(linger=1000)
        ctx.term()
    os._exit(code)  # skip interpreter teardown (CUDA, process groups) once the engine is told


def _start_runner(config: EngineConfig, rank: int, world_size: int, dist_init: str):
    import torch

    from tinyvllm.worker.model_runner import ModelRunner, resolve_device

    device = resolve_device(config.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)  # one device per rank; "cuda" below means this one
    if world_size > 1:
        from tinyvllm import distributed
        distributed.init_tensor_parallel(rank, world_size, init_method=dist_init,
                                         backend="nccl" if device.type == "cuda" else "gloo")
    return ModelRunner(config)


class _WorkerLoop:
    """Main thread: receive a step, launch it, queue its handle. Result thread: wait for each
    handle in order (appending the sampled tokens to the records) and, on rank 0, send it. A
    step that verifies drafts first waits until every earlier handle is done."""

    def __init__(self, runner: Any, rank: int, steps: zmq.Socket, send, encoder):
        self.runner = runner
        self.rank = rank
        self.steps = steps
        self.send = send
        self.encoder = encoder
        self.decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self.handles: "queue.Queue[Optional[tuple[int, Any]]]" = queue.Queue()

    def run(self) -> None:
        results = threading.Thread(target=self._results, name="tinyvllm-worker-results",
                                   daemon=True)
        results.start()
        try:
            while True:
                kind, payload = self.steps.recv_multipart()
                if kind == _QUIT:
                    break
                if kind == _SYNC:
                    self.send(_ACK, str(self.rank).encode())
                    continue
                out = self.decoder.decode(payload)
                if any(s.draft_token_ids for s in out.scheduled):
                    # A verification row reads its last sampled token from the records, which the
                    # result thread fills: on ranks other than 0 the previous step's result may
                    # still be pending when this step arrives (rank 0 sent it first).
                    self.handles.join()
                handle = self.runner.execute_async(out)
                if not out.is_empty:
                    self.handles.put((out.step_id, handle))
        finally:
            self.handles.put(None)
            results.join()

    def _results(self) -> None:
        try:
            while (item := self.handles.get()) is not None:
                step_id, handle = item
                sampled = handle.result()
                if self.rank == 0:
                    self.send(_OUTPUT, self.encoder.encode(
                        _Output(step_id, sampled, handle.prompt_logprobs,
                                handle.draft_token_ids)))
                self.handles.task_done()
        except BaseException as e:  # noqa: BLE001 - the main thread may be blocked in recv
            detail = "".join(traceback.format_exception(e))
            print(f"tinyvllm worker rank {self.rank} failed:\n{detail}", file=sys.stderr,
                  flush=True)
            self.send(_ERROR, self.encoder.encode(_Error(self.rank, f"{type(e).__name__}: {e}")))
            os._exit(1)
