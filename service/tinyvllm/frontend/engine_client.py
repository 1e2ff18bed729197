"""`AsyncEngineClient`: the frontend's handle on the engine-core process.

```
generate() ──▶ validate ─▶ RequestPool.acquire ─▶ OutputProcessor.add_request ─▶ PUSH AddRequests
                                                    (sends of one event-loop tick are batched)
_output_loop: PULL StepOutputs ─▶ OutputProcessor.process_outputs (detokenize, stop strings)
              ─▶ RequestState.collector.put ─▶ generate() yields ─▶ stream
              ─▶ AbortRequests for requests finished by a stop string
_watch_process: engine exit or EngineFailed ─▶ every stream fails, on_dead() is called
               work in flight and no step for stall_timeout_s ─▶ is_stalled (health NOT_SERVING)
```

Callers name requests with their own ids (echoed back, need not be unique); the engine sees ids
this client assigns, so one caller can never abort or confuse another's request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from tinyvllm.config import EngineConfig, RuntimeInfo
from tinyvllm.engine import core_proc
from tinyvllm.engine.stats import EngineStats
from tinyvllm.scheduling.request import EngineCoreOutput, EngineCoreRequest, FinishReason
from tinyvllm.engine.validation import validate_request
from tinyvllm.frontend.errors import (EngineDeadError, EngineRequestError,
                                      EngineUnavailableError, QueueFullError)
from tinyvllm.frontend.request_pool import RequestPool, RequestState
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("tinyvllm.access")
"""One line per finished stream (any outcome); `record.fields` holds the values for JSON logs."""

WATCHDOG_INTERVAL_S = 0.1
"""How often the frontend checks that the engine process is alive."""

SHUTDOWN_TIMEOUT_S = 10.0
"""How long the engine gets to exit after Shutdown before it is killed."""

STARTUP_STOP_TIMEOUT_S = 3.0
"""How long an engine that is still starting gets to exit on SIGTERM before it is killed."""


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """`fn(*args)` on a daemon thread: unlike an executor's threads, it does not hold up the
    process's exit (a SIGTERM while the tokenizer still loads exits at once)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: Optional[BaseException]) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=run, name=f"tinyvllm-{fn.__name__}", daemon=True).start()
    return future


class EngineObserver:
    """Hooks for metrics; the default does nothing. Times are `time.monotonic()` seconds."""

    def on_step(self, stats: EngineStats) -> None: ...

    def on_first_token(self, ttft_s: float, queue_s: float) -> None: ...

    def on_inter_token(self, latency_s: float) -> None: ...

    def on_finished(self, finish_reason: FinishReason, e2e_s: float) -> None: ...


class AsyncEngineClient:
    """Starts the engine process and multiplexes request streams over its two sockets.

    Args:
        config: the engine configuration (sent to the engine process).
        observer: metrics hooks.
        on_dead: called once, with the reason, when the engine process fails or exits.
        engine_class: "module:Class" the engine process instantiates (tests use a fake).
        stall_timeout_s: with requests in flight, this long without a step from the engine makes
            it `is_stalled`.
        sigterm_grace_s: how long the engine keeps serving after a SIGTERM of its own while this
            process lives (a signal sent to the whole process group must not cut a drain short).
    """

    def __init__(self, config: EngineConfig, *, observer: Optional[EngineObserver] = None,
                 on_dead: Optional[Callable[[str], None]] = None,
                 engine_class: str = core_proc.DEFAULT_ENGINE_CLASS,
                 stall_timeout_s: float = 60.0, sigterm_grace_s: float = 60.0) -> None:
        self.config = config
        self.stall_timeout_s = stall_timeout_s
        self.sigterm_grace_s = sigterm_grace_s
        self.observer = observer or EngineObserver()
        self.on_dead = on_dead
        self.engine_class = engine_class
        self.runtime_info: Optional[RuntimeInfo] = None
        self.tokenizer: Any = None
        self._processor: Any = None  # OutputProcessor, made once the tokenizer is loaded
        self.engine_pid: Optional[int] = None
        self.stats: Optional[EngineStats] = None  # from the engine's latest message
        self.dead_reason: Optional[str] = None
        self.draining = False
        self._states: dict[str, RequestState] = {}  # by engine-side request id
        self._request_ids = itertools.count()
        self._last_progress = time.monotonic()  # last step, or when work arrived at an idle engine
        self._engine_idle = True  # its last message said nothing was running or waiting
        self._pool = RequestPool()
        self._num_waiting = 0
        self._pending_adds: list[EngineCoreRequest] = []
        self._pending_aborts: list[str] = []
        self._flush_scheduled = False
        self._closing = False
        self._ready: Optional[asyncio.Future] = None
        self._tasks: list[asyncio.Task] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(core_proc.EngineOutput)

    # --- life cycle -------------------------------------------------------------------------------

    async def start(self, ready_timeout_s: float = 900.0) -> None:
        """Start the engine process and wait for READY (model loaded and warmed up).

        Raises:
            EngineUnavailableError: the engine failed to start or timed out.
        """
        from tinyvllm.frontend.output_processor import OutputProcessor
        from tinyvllm.tokenization import load_tokenizer

        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._open_sockets()
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=core_proc.run_engine_core, name="tinyvllm-engine-core", daemon=True,
            args=(self.config, self._input_addr, self._output_addr, self.engine_class),
            kwargs=dict(parent_pid=os.getpid(), ipc_dir=self._ipc_dir,
                        sigterm_grace_s=self.sigterm_grace_s))
        self._proc.start()
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._watch_process(), name="engine-watchdog")]
        # Load the (cheap) tokenizer while the engine loads the model.
        self.tokenizer = await _in_daemon_thread(load_tokenizer, self.config.model.model)
        self._processor = OutputProcessor(self.tokenizer.backend)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), ready_timeout_s)
        except asyncio.TimeoutError:
            self._mark_dead(f"engine not ready after {ready_timeout_s:.0f}s")
            raise EngineUnavailableError(self.dead_reason) from None
        if self.dead_reason is not None:
            raise EngineUnavailableError(self.dead_reason)

    def _open_sockets(self) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="tinyvllm-")
        self._input_addr, self._output_addr = core_proc.ipc_addresses(self._ipc_dir)
        self._zmq = zmq.asyncio.Context()
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block or drop a send: the loop can't wait
        self._input.bind(self._input_addr)
        self._output = self._zmq.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self._output_addr)

    async def shutdown(self) -> None:
        """Stop the engine process (Shutdown, then kill after SHUTDOWN_TIMEOUT_S) and clean up."""
        if self._closing:
            return
        self._closing = True
        self._fail_all("the server is shutting down", EngineUnavailableError)
        if self._proc.is_alive():
            timeout_s = SHUTDOWN_TIMEOUT_S
            if self.runtime_info is None:  # still loading: it reads no input yet
                self._proc.terminate()
                timeout_s = STARTUP_STOP_TIMEOUT_S
            else:
                self._send(core_proc.Shutdown())
            deadline = time.monotonic() + timeout_s
            while self._proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if self._proc.is_alive():
                self._proc.kill()
            logger.info("engine core stopped")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def is_ready(self) -> bool:
        # The engine's READY can arrive before the frontend's tokenizer has loaded.
        return (self.runtime_info is not None and self._processor is not None
                and self.dead_reason is None)

    @property
    def is_stalled(self) -> bool:
        """Requests are in flight and the engine has sent no step for stall_timeout_s."""
        if time.monotonic() - self._last_progress <= self.stall_timeout_s:
            return False
        # A finished request whose stream is still open (a slow reader) is no work for the engine.
        return any(not state.finished for state in self._states.values())

    @property
    def is_healthy(self) -> bool:
        """Ready, not draining, not stalled: what health probes report as SERVING."""
        return self.is_ready and not self.draining and not self.is_stalled

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    @property
    def num_waiting(self) -> int:
        """Requests without a first token yet (queued in the engine or prefilling)."""
        return self._num_waiting

    # --- requests ---------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                       params: SamplingParams, *, priority: int = 0,
                       cache_salt: Optional[str] = None,
                       arrival_time: Optional[float] = None) -> AsyncIterator[Any]:
        """Stream `RequestOutput`s (deltas merged if the caller is slow) until one is finished.

        `request_id` is the caller's: it is echoed in the outputs and errors, and need not be
        unique (the engine runs the request under an id of this client's).

        Raises (before the first output): InvalidRequestError, QueueFullError,
        EngineUnavailableError. Later: EngineDeadError, EngineRequestError. Leaving the
        iteration early (cancel, deadline, `aclose()`) aborts the request in the engine.
        """
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        state = self._admit(request_id, prompt, prompt_token_ids, params, priority, cache_salt,
                            arrival_time)
        try:
            while True:
                output = await state.collector.get()
                yield output
                if output.finished:
                    return
        finally:
            self._release(state)

    def _admit(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
               params: SamplingParams, priority: int, cache_salt: Optional[str],
               arrival_time: float) -> RequestState:
        self.check_accepting()
        max_waiting = self.config.scheduler.max_waiting_requests
        if self._num_waiting >= max_waiting:
            raise QueueFullError(f"{self._num_waiting} requests are waiting (limit {max_waiting})")
        engine_id = str(next(self._request_ids))
        req = EngineCoreRequest(request_id=engine_id, prompt_token_ids=prompt_token_ids,
                                sampling_params=params, arrival_time=arrival_time,
                                priority=priority, cache_salt=cache_salt)
        validate_request(req, self.runtime_info)
        if self._engine_idle:  # the stall clock starts when work arrives
            self._engine_idle = False
            self._last_progress = time.monotonic()
        state = self._pool.acquire(engine_id, arrival_time, external_request_id=request_id)
        self._states[engine_id] = state
        state.num_prompt_tokens = len(prompt_token_ids)
        self._num_waiting += 1
        self._processor.add_request(engine_id, prompt, prompt_token_ids, params, arrival_time)
        self._pending_adds.append(req)
        self._schedule_flush()
        return state

    def check_accepting(self) -> None:
        """Raises EngineUnavailableError unless new requests are taken now."""
        if self.dead_reason is not None:
            raise EngineUnavailableError(f"engine is down: {self.dead_reason}")
        if self.draining or self._closing:
            raise EngineUnavailableError("server is draining and takes no new requests")
        if self.runtime_info is None or self._processor is None:
            raise EngineUnavailableError("engine is not ready yet")
        if self.is_stalled:
            raise EngineUnavailableError(
                f"engine has sent no step for over {self.stall_timeout_s:g}s with requests in "
                "flight (stalled)")

    def _release(self, state: RequestState) -> None:
        """End of a stream: abort the request in the engine unless it finished there."""
        request_id = state.request_id
        if self._states.get(request_id) is not state:
            return
        del self._states[request_id]
        if state.waiting:
            self._num_waiting -= 1
        if not state.finished:  # cancelled, deadline, or failed: the engine may still run it
            self._processor.abort_request(request_id)
            self.abort(request_id)
            self.observer.on_finished(FinishReason.ABORT, time.monotonic() - state.arrival_time)
            state.finish_reason = state.finish_reason or FinishReason.ABORT
        _log_access(state, time.monotonic())
        self._pool.release(state)

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop `request_id` and free its blocks (batched, never blocks)."""
        self._pending_aborts.append(request_id)
        self._schedule_flush()

    # --- sending: everything queued during one loop tick goes out as one message per kind --------

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._closing or self.dead_reason is not None:
            self._pending_adds, self._pending_aborts = [], []
            return
        if self._pending_adds:
            self._send(core_proc.AddRequests(self._pending_adds))
            self._pending_adds = []
        if self._pending_aborts:
            self._send(core_proc.AbortRequests(self._pending_aborts))
            self._pending_aborts = []

    def _send(self, msg: Any) -> None:
        # SNDHWM=0 and a bound PUSH socket: a send queues and returns; NOBLOCK asserts it. It can
        # only fail with no engine connected (gone, or not started): the watchdog reports that.
        try:
            self._input.send(self._encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("engine core not connected; %s not sent", type(msg).__name__)

    # --- receiving ----------------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            msg = self._decoder.decode(await self._output.recv())
            if isinstance(msg, core_proc.StepOutputs):
                self._on_step(msg)
            elif isinstance(msg, core_proc.Ready):
                self.runtime_info, self.engine_pid = msg.runtime_info, msg.pid
                logger.info("engine core ready (pid %d): %s", msg.pid, msg.runtime_info)
                if not self._ready.done():
                    self._ready.set_result(None)
            else:
                self._mark_dead(f"engine core failed: {msg.error}")
                return

    def _on_step(self, msg: core_proc.StepOutputs) -> None:
        self._last_progress = time.monotonic()
        self._engine_idle = not (msg.stats.num_running or msg.stats.num_waiting)
        self.stats = msg.stats
        self.observer.on_step(msg.stats)
        outputs = [o for o in msg.outputs if o.request_id in self._states]
        failed = [o for o in outputs if o.error is not None]
        for o in failed:
            self._fail_request(o)
        if failed:
            outputs = [o for o in outputs if o.error is None]
        if not outputs:
            return
        processed = self._processor.process_outputs(outputs)
        now = time.monotonic()
        for out in processed.request_outputs:
            state = self._states.get(out.request_id)
            if state is not None:
                self._deliver(state, out, now, msg.step_start_time)
        if processed.reqs_to_abort:
            for request_id in processed.reqs_to_abort:
                self.abort(request_id)

    def _deliver(self, state: RequestState, out: Any, now: float, step_start: float) -> None:
        out.request_id = state.external_request_id
        if getattr(out, "error", None) is not None:
            if state.waiting:
                self._num_waiting -= 1
            state.finished = True
            state.finish_reason = FinishReason.ERROR
            state.collector.fail(EngineRequestError(state.external_request_id, out.error))
            return
        if out.outputs[0].delta_token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
                state.queue_s = max(0.0, step_start - state.arrival_time)
                out.metrics.first_scheduled_time = step_start
                self._num_waiting -= 1
                self.observer.on_first_token(now - state.arrival_time, state.queue_s)
            else:
                self.observer.on_inter_token(now - state.last_token_time)
            state.last_token_time = now
            state.num_output_tokens += len(out.outputs[0].delta_token_ids)
        if out.finished:
            if state.waiting:
                self._num_waiting -= 1
            state.finished = True
            state.finish_reason = out.outputs[0].finish_reason
            state.num_cached_tokens = out.num_cached_tokens or 0
            self.observer.on_finished(state.finish_reason, now - state.arrival_time)
        state.collector.put(out)

    def _fail_request(self, output: EngineCoreOutput) -> None:
        state = self._states[output.request_id]
        self._processor.abort_request(output.request_id)
        if state.waiting:
            self._num_waiting -= 1
        state.finished = True  # the engine has dropped it already
        state.finish_reason = FinishReason.ERROR
        state.collector.fail(EngineRequestError(state.external_request_id, output.error))

    # --- engine death ------------------------------------------------------------------------------

    async def _watch_process(self) -> None:
        while self._proc.exitcode is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if not self._closing:
            self._mark_dead(f"engine process exited with code {self._proc.exitcode}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None or self._closing:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        self._fail_all(reason, EngineDeadError)
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)
        if self.on_dead is not None:
            self.on_dead(reason)

    def abort_all(self, reason: str) -> None:
        """End every in-flight stream with EngineUnavailableError (e.g. at the drain timeout)."""
        self._fail_all(reason, EngineUnavailableError)

    def _fail_all(self, reason: str, error_type: type) -> None:
        for state in self._states.values():
            if not state.finished:
                state.finish_reason = FinishReason.ERROR
                err = (error_type(state.external_request_id, reason)
                       if error_type is EngineDeadError
                       else error_type(reason))
                state.collector.fail(err)


def _log_access(state: RequestState, now: float) -> None:
    """The access-log line of a stream that ends now (vLLM-style fields, times from arrival)."""
    if not access_logger.isEnabledFor(logging.INFO):
        return

    def since_arrival(t: Optional[float]) -> Optional[float]:
        return None if t is None else round(t - state.arrival_time, 4)

    fields = {"request_id": state.external_request_id or state.request_id, "prompt_tokens": state.num_prompt_tokens,
              "completion_tokens": state.num_output_tokens,
              "cached_tokens": state.num_cached_tokens, "finish_reason": state.finish_reason,
              "ttft_s": since_arrival(state.first_token_time),
              "e2e_s": round(now - state.arrival_time, 4),
              "queue_s": None if state.queue_s is None else round(state.queue_s, 4)}
    access_logger.info("request %s", " ".join(f"{k}={v}" for k, v in fields.items()),
                       extra={"fields": fields})
