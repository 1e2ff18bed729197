"""ModelRunner.execute_async on the CPU: decode inputs taken from the previous step's samples."""

from __future__ import annotations

import pytest

from tinyvllm.scheduling.scheduler import ScheduledRequest, SchedulerOutput

from .test_model_runner import PROMPTS, loaded, make_runner, request  # noqa: F401


def in_flight_decode(r) -> SchedulerOutput:
    """The decode of `r`'s token in flight, scheduled as the async scheduler does."""
    r.num_output_placeholders = 1
    out = SchedulerOutput([ScheduledRequest(r, 1)])
    r.num_computed_tokens += 1
    return out


def test_decode_input_is_the_previous_steps_sample(loaded):
    runner = make_runner(loaded)
    a = request("a", PROMPTS[0], [], 0, [3, 9, 5, 8])
    b = request("b", PROMPTS[1], [], 0, [7, 2])
    handle = runner.execute_async(SchedulerOutput([ScheduledRequest(a, len(PROMPTS[0])),
                                                   ScheduledRequest(b, len(PROMPTS[1]))]))
    a.num_computed_tokens, b.num_computed_tokens = len(PROMPTS[0]), len(PROMPTS[1])
    # a's next input is known on the host (as if updates had run); b's is the token in flight.
    a.output_token_ids += [handle.result()["a"][0], 123]
    a.num_computed_tokens += 1
    b.num_output_placeholders = 1
    out = SchedulerOutput([ScheduledRequest(a, 1), ScheduledRequest(b, 1)])
    inputs = runner._prepare_inputs(out)
    buf = runner.buffers
    assert buf.input_ids.device[:2].tolist() == [123, handle.result()["b"][0]]
    assert buf.prev_token_dst.np[:1].tolist() == [1] and buf.prev_token_src.np[:1].tolist() == [1]
    assert buf.positions.np[:2].tolist() == [len(PROMPTS[0]) + 1, len(PROMPTS[1])]
    assert [r.request_id for r in inputs.sampled_requests] == ["a", "b"]


def test_execute_is_execute_async_result(loaded):
    runner = make_runner(loaded)
    r = request("a", PROMPTS[1], [], 0, [7, 2])
    out = SchedulerOutput([ScheduledRequest(r, len(PROMPTS[1]))])
    expected = make_runner(loaded).execute(out)
    handle = runner.execute_async(out)
    assert handle.result() == expected and handle.result() is handle.result()


def test_unknown_input_without_previous_sample_is_refused(loaded):
    runner = make_runner(loaded)
    r = request("a", PROMPTS[1], [], len(PROMPTS[1]), [7, 2])
    with pytest.raises(RuntimeError, match="neither known"):
        runner._prepare_inputs(in_flight_decode(r))
