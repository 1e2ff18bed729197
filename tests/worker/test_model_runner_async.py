"""ModelRunner.execute_async on the CPU: decode inputs taken from the previous step's samples."""

from __future__ import annotations

import pytest

from tinyvllm.scheduling.output import NewRequest, ScheduledRequest, SchedulerOutput
from tinyvllm.worker.requests import apply_scheduler_output

from .test_model_runner import GREEDY, PROMPTS, loaded, make_runner  # noqa: F401

N0, N1 = len(PROMPTS[0]), len(PROMPTS[1])


def prefill_two() -> SchedulerOutput:
    """Requests a and b, each whole prompt in one step."""
    return SchedulerOutput(
        step_id=0, new_requests=[NewRequest("a", PROMPTS[0], GREEDY),
                                 NewRequest("b", PROMPTS[1], GREEDY)],
        scheduled=[ScheduledRequest("a", N0, 0, True, new_block_ids=[3, 9, 5, 8]),
                   ScheduledRequest("b", N1, 0, True, new_block_ids=[7, 2])])


def decode_two(step_id: int, offset: int = 0) -> SchedulerOutput:
    """The decode of a's and b's next tokens (`offset` tokens past their prompts)."""
    return SchedulerOutput(step_id=step_id, scheduled=[
        ScheduledRequest("a", 1, N0 + offset, True, block_offset=4),
        ScheduledRequest("b", 1, N1 + offset, True, block_offset=2)])


def test_decode_input_is_the_previous_steps_sample(loaded):
    runner = make_runner(loaded)
    first = runner.execute_async(prefill_two())
    # Scheduled before the first step's samples are read: both inputs are tokens in flight.
    out = decode_two(1)
    inputs = runner._prepare_inputs(out, apply_scheduler_output(runner.requests, out, "cpu"))
    buf = runner.buffers
    sampled = first.result()
    assert buf.input_ids.device[:2].tolist() == [sampled["a"][0], sampled["b"][0]]
    assert buf.prev_token_dst.np[:2].tolist() == [0, 1]
    assert buf.prev_token_src.np[:2].tolist() == [0, 1]
    assert buf.positions.np[:2].tolist() == [N0, N1]
    assert [r.request_id for r in inputs.sampled_requests] == ["a", "b"]


def test_records_append_what_the_step_sampled(loaded):
    runner = make_runner(loaded)
    sampled = runner.execute_async(prefill_two()).result()
    assert runner.requests["a"].output_token_ids == [sampled["a"][0]]
    out = decode_two(1)
    runner._prepare_inputs(out, apply_scheduler_output(runner.requests, out, "cpu"))
    # Known on the host now: taken from the record, nothing from the previous samples.
    assert runner.buffers.input_ids.np[:2].tolist() == [sampled["a"][0], sampled["b"][0]]


def test_execute_is_execute_async_result(loaded):
    expected = make_runner(loaded).execute(prefill_two())
    handle = make_runner(loaded).execute_async(prefill_two())
    assert handle.result() == expected and handle.result() is handle.result()


def test_unknown_input_without_previous_sample_is_refused(loaded):
    runner = make_runner(loaded)
    out = SchedulerOutput(new_requests=[NewRequest("a", PROMPTS[1], GREEDY)],
                          scheduled=[ScheduledRequest("a", 1, N1, True, new_block_ids=[7, 2])])
    with pytest.raises(RuntimeError, match="neither known"):
        runner._prepare_inputs(out, apply_scheduler_output(runner.requests, out, "cpu"))


def test_step_for_an_unknown_request_is_refused(loaded):
    runner = make_runner(loaded)
    with pytest.raises(RuntimeError, match="before the worker was told"):
        runner.execute_async(decode_two(0))
