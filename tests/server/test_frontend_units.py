"""Fast tests without the model: delta merging, request pooling, proto conversion, status mapping,
and the engine-process protocol against a fake engine core (a fault takes the engine down cleanly).
"""

from __future__ import annotations

import asyncio

import grpc
import msgspec
import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine import core_proc
from tinyvllm.engine.stats import EngineStats
from tinyvllm.errors import InvalidRequestError
from tinyvllm.frontend.collector import RequestOutputCollector
from tinyvllm.frontend.engine_client import AsyncEngineClient
from tinyvllm.frontend.errors import (EngineDeadError, EngineUnavailableError, QueueFullError)
from tinyvllm.frontend.request_pool import RequestPool
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.scheduling.request import EngineCoreOutput, FinishReason
from tinyvllm.server import convert
from tinyvllm.server.errors import status_for
from tinyvllm.server.metrics import ServerMetrics
from tinyvllm.v1 import generation_pb2 as pb

from .fake_engine import FAIL_TOKEN

FAKE_ENGINE = "tests.server.fake_engine:FakeEngineCore"


def _output(delta_text: str, delta_ids: list[int], finished: bool = False) -> RequestOutput:
    c = CompletionOutput(index=0, delta_text=delta_text, delta_token_ids=delta_ids,
                         finish_reason=FinishReason.LENGTH if finished else None)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[c],
                         finished=finished, num_cached_tokens=0, metrics=RequestMetrics(0.0))


async def test_collector_coalesces_deltas_for_a_slow_consumer():
    collector = RequestOutputCollector()
    for i, text in enumerate(["a", "b", "c"]):
        collector.put(_output(text, [i]))
    collector.put(_output("d", [3], finished=True))
    merged = await collector.get()
    assert merged.outputs[0].delta_text == "abcd"
    assert merged.outputs[0].delta_token_ids == [0, 1, 2, 3] and merged.finished
    collector.put(_output("e", [4]))
    assert (await collector.get()).outputs[0].delta_text == "e"


async def test_collector_error_wakes_the_consumer():
    collector = RequestOutputCollector()
    getter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    collector.fail(EngineDeadError("r", "gone"))
    with pytest.raises(EngineDeadError):
        await getter


def test_request_pool_reuses_and_resets_states():
    pool = RequestPool()
    a = pool.acquire("a", 1.0)
    a.first_token_time = 2.0
    pool.release(a)
    b = pool.acquire("b", 3.0)
    assert b is a and pool.num_allocated == 1
    assert (b.request_id, b.arrival_time, b.first_token_time, b.waiting) == ("b", 3.0, None, True)


def test_sampling_parameters_keep_meaningful_zeros_and_defaults():
    stream = convert.StreamSpec(logprobs=2)
    msg = pb.SamplingParameters(temperature=0.0, seed=0, max_tokens=7, stop=["x"])
    params = convert.sampling_params_from_proto(msg, stream)
    assert (params.temperature, params.seed, params.max_tokens, params.stop) == (0.0, 0, 7, ["x"])
    assert params.logprobs == 2
    default = convert.sampling_params_from_proto(pb.SamplingParameters(), convert.StreamSpec())
    assert default == SamplingParams(logprobs=None)


def test_stream_options_defaults():
    assert convert.stream_spec_from_proto(pb.GenerateRequest()) == convert.StreamSpec()
    req = pb.GenerateRequest(stream=pb.StreamOptions(text=False, token_ids=True))
    assert convert.stream_spec_from_proto(req) == convert.StreamSpec(text=False, token_ids=True)


def test_prompt_logprobs_asked_in_stream_options_come_on_the_first_response():
    req = pb.GenerateRequest(stream=pb.StreamOptions(prompt_logprobs=1))
    stream = convert.stream_spec_from_proto(req)
    assert convert.sampling_params_from_proto(req.sampling, stream).prompt_logprobs == 1
    out = RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=[4, 5], finished=False, num_cached_tokens=0,
        outputs=[CompletionOutput(index=0, delta_text="", delta_token_ids=[7])],
        metrics=RequestMetrics(arrival_time=0.0),
        prompt_logprobs=[None, {5: Logprob(-2.5, 3, "five"), 9: Logprob(-0.5, 1, "nine")}])
    first = convert.response_from_output(out, stream, first=True)  # no text yet: still sent
    (lp,) = first.prompt_logprobs
    assert (lp.token_id, lp.logprob, lp.rank, lp.token) == (5, -2.5, 3, "five")
    assert [(t.token_id, t.logprob) for t in lp.top_logprobs] == [(9, -0.5)]
    assert convert.response_from_output(out, stream) is None


@pytest.mark.parametrize("exc,code", [
    (InvalidRequestError("prompt", "must not be empty"), grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineUnavailableError("draining"), grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError("req-7", "exit 9"), grpc.StatusCode.INTERNAL),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
])
def test_status_mapping(exc, code):
    got, details = status_for(exc)
    assert got == code
    if code == grpc.StatusCode.INTERNAL:
        assert "req-7" in details
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details.startswith(exc.field_name + ":")


def test_unknown_errors_are_internal_with_the_request_id():
    from tinyvllm.server.errors import current_request_id

    current_request_id.set("req-42")
    code, details = status_for(KeyError("boom"))
    assert code == grpc.StatusCode.INTERNAL and "req-42" in details


def test_step_outputs_cross_the_ipc_typed():
    """The engine's message decodes to what it was built from: FinishReason members and an
    EngineStats, not strings and dicts."""
    msg = core_proc.StepOutputs(
        outputs=[EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH),
                 EngineCoreOutput("b", [6])],
        stats=EngineStats(num_running=1, num_scheduled_tokens=2,
                          spec_num_accepted_per_position=[3, 1]),
        step_start_time=1.5)
    decoded = msgspec.msgpack.Decoder(core_proc.EngineOutput).decode(msgspec.msgpack.encode(msg))
    assert decoded == msg
    assert decoded.outputs[0].finish_reason is FinishReason.LENGTH
    assert decoded.outputs[1].finish_reason is None
    assert type(decoded.stats) is EngineStats and decoded.stats.num_scheduled_tokens == 2


def test_metrics_read_the_engine_stats_and_finish_reasons():
    metrics = ServerMetrics()
    metrics.set_model_name("m")
    assert 'tinyvllm:num_requests_running{model_name="m"} 0.0' in metrics.render().decode()
    metrics.on_step(EngineStats(num_running=2, num_generation_tokens=7, num_scheduled_tokens=8,
                                spec_num_accepted_per_position=[4, 1]))
    metrics.on_finished(FinishReason.STOP, 0.5)
    text = metrics.render().decode()
    for line in ('tinyvllm:num_requests_running{model_name="m"} 2.0',
                 'tinyvllm:generation_tokens_total{model_name="m"} 7.0',
                 'tinyvllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
                 'position="1"} 1.0',
                 'tinyvllm:request_success_total{finished_reason="stop",model_name="m"} 1.0',
                 'tinyvllm:iteration_tokens_total_sum{model_name="m"} 8.0'):
        assert line in text, line


async def _collect(client: AsyncEngineClient, request_id: str, prompt_ids: list[int],
                   max_tokens: int) -> list[int]:
    ids: list[int] = []
    async for out in client.generate(request_id, None, prompt_ids,
                                     SamplingParams(max_tokens=max_tokens)):
        ids.extend(out.outputs[0].delta_token_ids)
    return ids


async def test_engine_process_round_trip_and_fault():
    """Fake engine core in a real spawned process: streams work; a fault fails them, not hangs."""
    dead: list[str] = []
    config = EngineConfig.from_kwargs(max_waiting_requests=64)
    client = AsyncEngineClient(config, on_dead=dead.append, engine_class=FAKE_ENGINE)
    await client.start(ready_timeout_s=120)
    try:
        results = await asyncio.gather(*(_collect(client, f"r{i}", [100 + i], 3)
                                         for i in range(8)))
        assert results == [[101 + i, 102 + i, 103 + i] for i in range(8)]
        assert client.num_in_flight == 0 and client.stats.num_running == 0
        with pytest.raises(InvalidRequestError) as info:
            await _collect(client, "bad", [10**9], 3)
        assert info.value.field_name == "prompt_token_ids"
        victim = asyncio.ensure_future(_collect(client, "victim", [200], 10_000))
        await asyncio.sleep(0.2)
        with pytest.raises(EngineDeadError) as dead_info:
            await asyncio.gather(_collect(client, "killer", [FAIL_TOKEN], 3), victim)
        assert dead_info.value.request_id in ("killer", "victim")
        for _ in range(50):
            if client._proc.exitcode is not None:
                break
            await asyncio.sleep(0.1)
        assert client._proc.exitcode == 1 and dead and "injected engine fault" in dead[0]
        with pytest.raises(EngineUnavailableError):
            await _collect(client, "late", [5], 1)
    finally:
        await client.shutdown()
