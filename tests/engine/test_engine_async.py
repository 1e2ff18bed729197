"""EngineCore with async scheduling on the CPU, over a tiny random model.

On the CPU a launched step is done at once, but the order is the GPU's: step N+1 is scheduled
and run before step N's tokens reach the scheduler, and its decode input ids come from step N's
samples through the device-side copy. The asynchronous engine must produce exactly what the
synchronous one does, emit nothing past a finish, and leak no block.
"""

from __future__ import annotations

import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import UniProcExecutor
from tinyvllm.scheduling.request import EngineCoreRequest
from tinyvllm.model.loader import LoadedModel
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner

from .conftest import assert_all_blocks_free

PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 7, 199, 12], [9, 8, 7, 6, 5],
           [100, 200, 150, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tiny_model) -> LoadedModel:
    return tiny_model


def make_engine(tiny, async_scheduling=True, **kwargs) -> EngineCore:
    kwargs.setdefault("num_kv_blocks", 64)
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32", block_size=4,
                                      async_scheduling=async_scheduling, **kwargs)
    return EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=tiny)))


def add(engine: EngineCore, prompts, params: SamplingParams) -> None:
    for i, ids in enumerate(prompts):
        engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=ids,
                                             sampling_params=params))


def drain(engine: EngineCore, results: dict | None = None) -> dict[str, dict]:
    """Step until done; per request: token ids, logprobs and the finish reason (asserted last)."""
    results = {} if results is None else results
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"ids": [], "logprobs": [], "finish": None})
            assert r["finish"] is None, f"request {out.request_id}: a token after its finish"
            r["ids"] += out.new_token_ids
            r["logprobs"] += out.new_logprobs or []
            r["finish"] = out.finish_reason
    return results


def generate(engine: EngineCore, params: SamplingParams, prompts=PROMPTS) -> dict[str, dict]:
    add(engine, prompts, params)
    results = drain(engine)
    assert_all_blocks_free(engine)
    return results


def count_prev_token_fills(engine: EngineCore) -> list[int]:
    """Counts the steps whose decode inputs came from the previous step's samples."""
    calls = [0]
    buffers = engine.runner.buffers
    fill = buffers.fill_prev_token_ids

    def counted(*args):
        calls[0] += 1
        return fill(*args)

    buffers.fill_prev_token_ids = counted
    return calls


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=MAX_TOKENS,
                             ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.0, logprobs=3, max_tokens=MAX_TOKENS,
                               ignore_eos=True),
    # These read the output ids on the host when sampling: synchronous steps.
    "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                                max_tokens=MAX_TOKENS, ignore_eos=True),
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=4, max_tokens=MAX_TOKENS),
}
ENGINES = {"batched": {}, "chunked": {"max_num_batched_tokens": 5},
           "preempting": {"num_kv_blocks": 12}}  # 11 blocks of 4 for 3 x up to 25 tokens


@pytest.mark.parametrize("engine_kwargs", ENGINES.values(), ids=ENGINES.keys())
@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_async_and_sync_give_identical_outputs(tiny, params, engine_kwargs):
    sync = generate(make_engine(tiny, async_scheduling=False, **engine_kwargs), params)
    engine = make_engine(tiny, **engine_kwargs)
    assert generate(engine, params) == sync
    assert all(len(r["ids"]) == MAX_TOKENS or r["finish"] == "stop" for r in sync.values())
    if "num_kv_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0


def test_decode_inputs_come_from_the_step_in_flight(tiny):
    engine = make_engine(tiny)
    fills = count_prev_token_fills(engine)
    generate(engine, PARAMS["greedy"])
    assert fills[0] == MAX_TOKENS - 1  # every decode step, once the first tokens were sampled
    engine = make_engine(tiny, async_scheduling=False)
    fills = count_prev_token_fills(engine)
    generate(engine, PARAMS["greedy"])
    assert fills[0] == 0


@pytest.mark.parametrize("name, num_sync_steps", [("greedy", 0), ("logprobs", 0),
                                                  ("penalties", MAX_TOKENS - 1),
                                                  ("seeded", 0), ("min_tokens", 4)])
def test_host_sampled_rows_fall_back_to_synchronous_steps(tiny, name, num_sync_steps):
    engine = make_engine(tiny)
    fills = count_prev_token_fills(engine)
    generate(engine, PARAMS[name])
    assert fills[0] == MAX_TOKENS - 1 - num_sync_steps


@pytest.mark.parametrize("how", ["eos", "stop_token_id"])
def test_stop_while_next_step_in_flight_emits_no_extra_token(tiny, how):
    greedy = PARAMS["greedy"]
    tokens = generate(make_engine(tiny, async_scheduling=False), greedy)["0"]["ids"]
    k = next(i for i in range(3, MAX_TOKENS) if tokens[i] not in tokens[:i])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            ignore_eos=how != "eos",
                            stop_token_ids=[tokens[k]] if how == "stop_token_id" else None)
    outputs = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny, async_scheduling=async_scheduling)
        if how == "eos":
            engine._eos = frozenset({tokens[k]})  # the model's EOS, as its tokenizer would say
        outputs[async_scheduling] = generate(engine, params)
    assert outputs[True] == outputs[False]
    assert outputs[True]["0"]["ids"] == tokens[:k + 1]
    assert outputs[True]["0"]["finish"] == "stop"


def test_max_tokens_1_computes_no_decode(tiny):
    engine = make_engine(tiny)
    scheduled = []
    launch = engine.runner.execute_async

    def counted(out):
        scheduled.append(out.num_scheduled_tokens)
        return launch(out)

    engine.runner.execute_async = counted
    results = generate(engine, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert [len(r["ids"]) for r in results.values()] == [1, 1, 1]
    assert {r["finish"] for r in results.values()} == {"length"}
    assert sum(scheduled) == sum(len(p) for p in PROMPTS)


def test_abort_with_step_in_flight(tiny):
    params = PARAMS["greedy"]
    expected = generate(make_engine(tiny, async_scheduling=False), params)
    engine = make_engine(tiny)
    add(engine, PROMPTS, params)
    results: dict = {}
    for _ in range(3):
        for out in engine.step():
            results.setdefault(out.request_id, {"ids": [], "logprobs": [], "finish": None})
            results[out.request_id]["ids"] += out.new_token_ids
    assert engine._in_flight is not None
    engine.abort_requests(["1"])
    emitted = list(results["1"]["ids"])
    drain(engine, results)
    assert results["1"]["ids"] == emitted  # nothing after the abort
    assert emitted == expected["1"]["ids"][:len(emitted)]
    for i in ("0", "2"):
        assert results[i]["ids"] == expected[i]["ids"]
    assert_all_blocks_free(engine)


def test_abort_all_with_step_in_flight(tiny):
    engine = make_engine(tiny)
    add(engine, PROMPTS, PARAMS["greedy"])
    engine.step()
    engine.step()
    engine.abort_requests([str(i) for i in range(len(PROMPTS))])
    assert engine.has_unfinished_requests()  # the step in flight
    assert engine.step() == []
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_shutdown_with_step_in_flight(tiny):
    engine = make_engine(tiny)
    add(engine, PROMPTS, PARAMS["greedy"])
    engine.step()
    assert engine._in_flight is not None
    engine.shutdown()
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)
