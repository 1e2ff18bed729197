"""OutputProcessor fed with hand-made EngineCoreOutput sequences."""

from __future__ import annotations

import math

import pytest

from tinyvllm.scheduling.request import EngineCoreOutput, FinishReason, Logprobs
from tinyvllm.frontend.output_processor import OutputProcessor
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling_params import SamplingParams

IM_END = "<|im_end|>"


@pytest.fixture
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def new_processor(tok, request_ids=("r1",), **params) -> OutputProcessor:
    processor = OutputProcessor(tok)
    for request_id in request_ids:
        prompt = "Say something"
        processor.add_request(request_id, prompt, encode(tok, prompt), SamplingParams(**params),
                              arrival_time=1.0)
    return processor


def step(processor, request_id: str, token_ids: list[int], **fields) -> list[RequestOutput]:
    result = processor.process_outputs([EngineCoreOutput(request_id, token_ids, **fields)])
    return result.request_outputs


def run_one_by_one(processor, request_id, token_ids, last_fields=None):
    """Feed tokens one per step; the last step carries last_fields. Returns all outputs."""
    outs = []
    for i, token_id in enumerate(token_ids):
        fields = last_fields if i == len(token_ids) - 1 and last_fields else {}
        outs += step(processor, request_id, [token_id], **fields)
    return outs


def test_streams_text_deltas_and_finishes_on_length(tok):
    text = "Hello 世界 🎉 and more"
    ids = encode(tok, text)
    processor = new_processor(tok)
    outs = run_one_by_one(processor, "r1", ids, {"finish_reason": FinishReason.LENGTH})
    completions = [o.outputs[0] for o in outs]
    assert "".join(c.delta_text for c in completions) == text
    assert [t for c in completions for t in c.delta_token_ids] == ids
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason is FinishReason.LENGTH
    assert final.outputs[0].text == text and final.outputs[0].token_ids == ids
    assert final.outputs[0].stop_reason is None
    assert all(not o.finished for o in outs[:-1])
    assert all(c.cumulative_logprob is None and c.logprobs is None for c in completions)
    assert not processor.has_unfinished_requests() and processor.num_unfinished == 0


def test_cumulative_fields_are_snapshots(tok):
    ids = encode(tok, "one two three")
    processor = new_processor(tok)
    outs = run_one_by_one(processor, "r1", ids, {"finish_reason": FinishReason.LENGTH})
    assert [o.outputs[0].token_ids for o in outs] == [ids[:i + 1] for i in range(len(ids))]
    assert [o.outputs[0].text for o in outs] == ["one", "one two", "one two three"]


def test_stop_string_finishes_aborts_and_truncates(tok):
    text = "Answer: 42<END> and garbage"
    ids = encode(tok, text)
    processor = new_processor(tok, stop=["<END>"])
    outs = run_one_by_one(processor, "r1", ids)
    final = outs[-1].outputs[0]
    assert outs[-1].finished and final.finish_reason is FinishReason.STOP
    assert final.stop_reason == "<END>"
    assert final.text == "Answer: 42" == "".join(o.outputs[0].delta_text for o in outs)
    assert all("<" not in o.outputs[0].delta_text for o in outs)
    # Token ids run up to and including the one that completed the stop string.
    assert final.token_ids == ids[:len(final.token_ids)] and len(final.token_ids) < len(ids)
    assert "<END>" in tok.decode(final.token_ids)
    assert "<END>" not in tok.decode(final.token_ids[:-1])
    # The engine is still running it: the caller must abort it there.
    result = processor.process_outputs([EngineCoreOutput("r1", [ids[-1]])])
    assert result.request_outputs == []  # late tokens of a finished request are dropped


def test_reqs_to_abort_lists_only_requests_stopped_by_a_string(tok):
    processor = new_processor(tok, request_ids=("a", "b", "c"), stop=["STOP"])
    stop_ids = encode(tok, "x STOP")
    result = processor.process_outputs([
        EngineCoreOutput("a", stop_ids),
        EngineCoreOutput("b", encode(tok, "fine")),
        EngineCoreOutput("c", encode(tok, "done"), finish_reason=FinishReason.LENGTH),
    ])
    assert result.reqs_to_abort == ["a"]
    assert [o.request_id for o in result.request_outputs] == ["a", "b", "c"]
    assert [o.finished for o in result.request_outputs] == [True, False, True]
    assert processor.num_unfinished == 1


def test_stop_string_in_the_engines_last_step_needs_no_abort(tok):
    processor = new_processor(tok, stop=["STOP"])
    result = processor.process_outputs([
        EngineCoreOutput("r1", encode(tok, "x STOP y"), finish_reason=FinishReason.LENGTH)])
    assert result.reqs_to_abort == []
    assert result.request_outputs[0].outputs[0].stop_reason == "STOP"


def test_eos_finish_keeps_the_token_and_drops_its_text(tok):
    eos = tok.token_to_id(IM_END)
    processor = new_processor(tok, skip_special_tokens=False)
    outs = step(processor, "r1", encode(tok, "Bye") + [eos], finish_reason=FinishReason.STOP)
    completion = outs[0].outputs[0]
    assert completion.text == completion.delta_text == "Bye"
    assert completion.token_ids[-1] == eos
    assert completion.finish_reason is FinishReason.STOP and completion.stop_reason is None


def test_stop_token_id_is_the_stop_reason(tok):
    stop_id = encode(tok, "\n\n")[0]
    processor = new_processor(tok, stop_token_ids=[stop_id])
    outs = step(processor, "r1", encode(tok, "line") + [stop_id],
                finish_reason=FinishReason.STOP, stop_reason=stop_id)
    completion = outs[0].outputs[0]
    assert completion.stop_reason == stop_id and completion.text == "line"


def test_held_back_text_is_released_on_engine_finish(tok):
    processor = new_processor(tok, stop=["a very long stop string"])
    first = step(processor, "r1", encode(tok, "short"))[0].outputs[0]
    assert first.delta_text == "" and first.text == ""  # held back: could start the stop string
    last = step(processor, "r1", encode(tok, " reply"),
                finish_reason=FinishReason.LENGTH)[0].outputs[0]
    assert last.delta_text == "short reply" == last.text


def test_logprobs_structure_and_cumulative_logprob(tok):
    ids = encode(tok, "Hi there")
    processor = new_processor(tok, logprobs=2)
    lps = [Logprobs(ids[0], -0.5, 1, [ids[0], 7], [-0.5, -1.5]),
           Logprobs(ids[1], -2.0, 3, [7, 8], [-1.0, -1.25])]
    outs = [step(processor, "r1", [ids[0]], new_logprobs=[lps[0]])[0],
            step(processor, "r1", [ids[1]], new_logprobs=[lps[1]],
                 finish_reason=FinishReason.LENGTH)[0]]
    text = {t: tok.decode([t], skip_special_tokens=False) for t in (*ids, 7, 8)}
    first = {ids[0]: Logprob(-0.5, 1, text[ids[0]]), 7: Logprob(-1.5, 2, text[7])}
    second = {ids[1]: Logprob(-2.0, 3, text[ids[1]]), 7: Logprob(-1.0, 1, text[7]),
              8: Logprob(-1.25, 2, text[8])}
    assert outs[0].outputs[0].delta_logprobs == [first]
    assert list(outs[1].outputs[0].delta_logprobs[0]) == [ids[1], 7, 8]  # sampled token first
    assert outs[1].outputs[0].delta_logprobs == [second]
    assert outs[1].outputs[0].logprobs == [first, second]
    assert outs[1].outputs[0].cumulative_logprob == pytest.approx(-2.5)
    assert text[ids[1]] == " there"


def test_logprobs_of_tokens_cut_by_a_stop_string_are_dropped(tok):
    ids = encode(tok, "a STOP b c")
    processor = new_processor(tok, logprobs=0, stop=["STOP"])
    lps = [Logprobs(t, -1.0, 1, [], []) for t in ids]
    completion = step(processor, "r1", ids, new_logprobs=lps)[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) < len(ids)
    assert completion.cumulative_logprob == pytest.approx(-len(completion.token_ids))


def test_abort_forgets_the_request(tok):
    processor = new_processor(tok, request_ids=("a", "b"))
    processor.abort_request("a")
    processor.abort_request("unknown")  # no error
    result = processor.process_outputs([EngineCoreOutput("a", [1]), EngineCoreOutput("b", [1])])
    assert [o.request_id for o in result.request_outputs] == ["b"]
    assert processor.num_unfinished == 1


def test_engine_abort_and_error_finish_the_request(tok):
    processor = new_processor(tok, request_ids=("a", "e"))
    result = processor.process_outputs([
        EngineCoreOutput("a", [], finish_reason=FinishReason.ABORT),
        EngineCoreOutput("e", [], finish_reason=FinishReason.ERROR, error="CUDA fault"),
    ])
    aborted, failed = result.request_outputs
    assert aborted.finished and aborted.outputs[0].finish_reason is FinishReason.ABORT
    assert failed.outputs[0].finish_reason is FinishReason.ERROR and failed.error == "CUDA fault"
    assert not processor.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(tok):
    processor = new_processor(tok)
    with pytest.raises(ValueError, match="^request_id"):
        processor.add_request("r1", None, [1], SamplingParams(), arrival_time=0.0)


def test_metrics_and_cached_tokens(tok):
    processor = new_processor(tok)
    first = step(processor, "r1", [], num_cached_tokens=2)[0]
    assert first.metrics.first_token_time is None and first.num_cached_tokens == 2
    mid = step(processor, "r1", encode(tok, "a b"))[0]
    first_token_time = mid.metrics.first_token_time
    assert first_token_time is not None and mid.metrics.num_generation_tokens == 2
    last = step(processor, "r1", encode(tok, " c"), finish_reason=FinishReason.LENGTH)[0]
    metrics = last.metrics
    assert metrics.arrival_time == 1.0 and metrics.first_token_time == first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time
    assert metrics.num_generation_tokens == 3 and last.num_cached_tokens == 2
    assert last.prompt == "Say something" and last.prompt_token_ids == encode(tok, "Say something")
    assert math.isfinite(metrics.finished_time)


def test_prompt_logprobs_of_prefill_chunks_arrive_with_the_first_token(tok):
    prompt = encode(tok, "Say something")
    processor = new_processor(tok, prompt_logprobs=1)
    chunk = [None, Logprobs(prompt[1], -3.0, 4, [7], [-0.25])]
    assert step(processor, "r1", [], new_prompt_logprobs=chunk) == []  # no token: no output
    rest = [Logprobs(t, -1.0, 1, [t], [-1.0]) for t in prompt[2:]]
    (out,) = step(processor, "r1", [8], new_prompt_logprobs=rest)
    text = {t: tok.decode([t], skip_special_tokens=False) for t in (*prompt, 7)}
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1] == {prompt[1]: Logprob(-3.0, 4, text[prompt[1]]),
                                      7: Logprob(-0.25, 1, text[7])}
    assert out.outputs[0].token_ids == [8] and out.metrics.num_generation_tokens == 1
    (last,) = step(processor, "r1", [9], finish_reason=FinishReason.LENGTH)
    assert last.prompt_logprobs == out.prompt_logprobs
