"""Scheduler under async scheduling, without a model: step N+1 is scheduled before update(N).

`AsyncDriver` does what `EngineCore.step()` does with a step in flight, with a token function in
place of the model, so that finishes, aborts and preemptions can be placed exactly.
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest

from tinyvllm.scheduling.request import FinishReason, RequestStatus
from tinyvllm.scheduling.scheduler import Scheduler, SchedulerOutput
from tinyvllm.sampling_params import SamplingParams

from .test_scheduler import BLOCK, make_request, make_scheduler

TokenFn = Callable[[str, int], int]
"""(request id, output index) -> the token the fake model samples there."""


def sevens(request_id: str, index: int) -> int:
    return 7


class AsyncDriver:
    """EngineCore.step() over a scheduler: launch N+1, then update(N) and return its outputs."""

    def __init__(self, s: Scheduler, token_fn: TokenFn = sevens):
        self.s = s
        self.token_fn = token_fn
        self.in_flight: Optional[tuple[SchedulerOutput, dict]] = None
        self.scheduled: list[SchedulerOutput] = []
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}

    def launch(self) -> Optional[tuple[SchedulerOutput, dict]]:
        if not self.s.has_unfinished_requests():
            return None
        out = self.s.schedule()
        self.scheduled.append(out)
        # The sample is decided at launch, like the model's: output index from the snapshot.
        sampled = {x.request_id: (self.token_fn(
            x.request_id,
            x.num_computed_tokens + x.num_new_tokens - self.s.requests[x.request_id].num_prompt_tokens), None)
            for x in out.scheduled if x.completes_sequence}
        return None if out.is_empty else (out, sampled)

    def step(self) -> list:
        current = self.in_flight or self.launch()
        self.in_flight = None
        if current is None:
            return []
        if self.s.can_schedule_ahead():
            self.in_flight = self.launch()
        outputs = self.s.update(*current)
        for o in outputs:
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                assert o.request_id not in self.finish_reasons, "a token after the finish"
                self.finish_reasons[o.request_id] = o.finish_reason
        for r in self.s.running:  # published blocks hold known token ids only
            assert self.s.kv.num_published_blocks(r.request_id) * BLOCK <= r.num_tokens
        return outputs

    def run(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if self.in_flight is None and not self.s.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("did not finish")

    def num_scheduled_tokens(self, request_id: str) -> int:
        return sum(x.num_new_tokens for out in self.scheduled for x in out.scheduled
                   if x.request_id == request_id)


def test_decode_is_scheduled_before_the_previous_token_is_known():
    s = make_scheduler()
    r = make_request("a", 7, max_tokens=10)
    s.add_request(r)
    first = s.schedule()
    assert (r.num_computed_tokens, r.num_output_placeholders) == (7, 1)
    second = s.schedule()  # before update(first): the decode of the token in flight
    x = second.scheduled[0]
    assert (x.num_computed_tokens, x.num_new_tokens, x.completes_sequence) == (7, 1, True)
    assert (r.num_computed_tokens, r.num_output_placeholders) == (8, 2)
    assert s.kv.block_ids(r.request_id) == [1, 2]  # position 7 fits in block 2
    assert [o.new_token_ids for o in s.update(first, {"a": (11, None)})] == [[11]]
    assert (r.output_token_ids, r.num_output_placeholders) == ([11], 1)
    third = s.schedule()  # position 8 opens block 3, before the token at 7 is known
    assert third.scheduled[0].num_computed_tokens == 8 and s.kv.block_ids(r.request_id) == [1, 2, 3]
    s.update(second, {"a": (12, None)})
    s.update(third, {"a": (13, None)})
    assert (r.output_token_ids, r.num_output_placeholders, r.num_computed_tokens) == (
        [11, 12, 13], 0, 9)  # 13 itself is not computed yet


@pytest.mark.parametrize("case", ["eos", "stop_token_id", "max_tokens"])
def test_finish_while_next_step_in_flight_emits_nothing_more(case):
    s = make_scheduler()
    stop = {"eos": 0, "stop_token_id": 42}.get(case)
    params = SamplingParams(temperature=0, max_tokens=3 if case == "max_tokens" else 10,
                            stop_token_ids=[42])
    r = make_request("a", 5, params=params)
    other = make_request("b", 6, max_tokens=8, start=300)
    s.add_request(r)
    s.add_request(other)
    driver = AsyncDriver(s, lambda rid, i: stop if stop is not None and (rid, i) == ("a", 2) else 7)
    driver.run()
    expected_reason = "length" if case == "max_tokens" else "stop"
    assert driver.outputs["a"] == [7, 7, 7 if stop is None else stop]
    assert driver.finish_reasons == {"a": expected_reason, "b": "length"}
    assert driver.outputs["b"] == [7] * 8
    if case == "max_tokens":  # the decode of the last token is never scheduled
        assert driver.num_scheduled_tokens("a") == 5 + 2
    else:  # known only at update: one decode was computed for nothing, and dropped
        assert driver.num_scheduled_tokens("a") == 5 + 3
    assert s.kv.num_free_blocks == 15 and not s.has_unfinished_requests()


def test_max_tokens_1_schedules_nothing_ahead():
    s = make_scheduler()
    r = make_request("a", 5, max_tokens=1)
    s.add_request(r)
    first = s.schedule()
    assert s.schedule().is_empty  # the token in flight is the last one
    outputs = s.update(first, {"a": (9, None)})
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([9], "length")]
    assert s.kv.num_free_blocks == 15 and r.num_output_placeholders == 0


def test_context_length_rules_out_the_decode_ahead():
    kv_sched = make_scheduler()
    kv_sched.max_model_len = 6
    r = make_request("a", 5, max_tokens=None)
    kv_sched.add_request(r)
    first = kv_sched.schedule()
    assert kv_sched.schedule().is_empty  # token 6 of 6 is in flight
    assert kv_sched.update(first, {"a": (9, None)})[0].finish_reason == "length"


def test_abort_with_step_in_flight_frees_blocks_and_drops_its_tokens():
    s = make_scheduler()
    a, b = make_request("a", 6, max_tokens=10), make_request("b", 6, max_tokens=3, start=200)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    second = s.schedule()
    s.abort_requests(["a"])
    assert a.finish_reason == FinishReason.ABORT and s.kv.block_ids(a.request_id) == []
    outputs = s.update(first, {"a": (1, None), "b": (2, None)})
    assert [o.request_id for o in outputs] == ["b"]  # a's token in flight is dropped
    assert [o.request_id for o in s.update(second, {"a": (3, None), "b": (4, None)})] == ["b"]
    assert a.output_token_ids == []
    driver = AsyncDriver(s)
    driver.run()
    assert b.output_token_ids == [2, 4, 7]
    assert s.kv.num_free_blocks == 15 and not s.has_unfinished_requests()


def _two_requests_on_three_blocks(token_fn: TokenFn, max_tokens=6):
    # 3 usable blocks of 4 tokens, two 4-token prompts: the first decode ahead needs a third block
    # for each; the second one preempts itself with its first token in flight.
    s = make_scheduler(num_blocks=4, caching=False)
    a = make_request("a", 4, max_tokens=max_tokens)
    b = make_request("b", 4, max_tokens=max_tokens, start=300)
    s.add_request(a)
    s.add_request(b)
    driver = AsyncDriver(s, token_fn)
    driver.step()  # prefill both, schedule ahead: b is preempted, its first token in flight
    assert b.num_preemptions == 1 and b.num_output_placeholders == 0
    assert b.output_token_ids == [token_fn("b", 0)]  # update(prefill) still gave it its token
    return s, driver, a, b


def test_preempted_with_token_in_flight_gets_it_once_and_finishes():
    s, driver, a, b = _two_requests_on_three_blocks(lambda rid, i: 10 + i)
    assert b.status == RequestStatus.PREEMPTED and s.num_waiting == 1
    driver.run()
    assert driver.outputs == {"a": [10, 11, 12, 13, 14, 15], "b": [10, 11, 12, 13, 14, 15]}
    assert driver.finish_reasons == {"a": "length", "b": "length"}
    assert s.kv.num_free_blocks == 3 and not s.has_unfinished_requests()


def test_preempted_request_finished_by_its_token_in_flight_leaves_the_queue():
    s, driver, a, b = _two_requests_on_three_blocks(lambda rid, i: 0 if rid == "b" else 7)
    assert b.is_finished and s.num_waiting == 0
    driver.run()
    assert driver.outputs == {"a": [7] * 6, "b": [0]}
    assert s.kv.num_free_blocks == 3 and not s.has_unfinished_requests()


@pytest.mark.parametrize("params, steps_in_sync", [
    (dict(repetition_penalty=1.2), 10),  # every step reads the output ids
    (dict(presence_penalty=0.5), 10),
    (dict(min_tokens=3), 3),  # until three tokens are known
])
def test_host_sampled_requests_are_not_scheduled_ahead(params, steps_in_sync):
    s = make_scheduler()
    r = make_request("a", 5, params=SamplingParams(temperature=0, max_tokens=10, **params))
    s.add_request(r)
    assert s.can_schedule_ahead()  # nothing in flight yet
    refused = 0
    for _ in range(10):
        out = s.schedule()
        refused += not s.can_schedule_ahead()
        s.update(out, {"a": (7, None)})
    assert refused == steps_in_sync and r.is_finished
