"""Prompt logprobs on the tiny model: the rows a chunk scores, across chunk boundaries, in pieces,
once per prompt token (not again after preemption), and through the engine."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.errors import InvalidRequestError
from tinyvllm.sampling_params import MAX_LOGPROBS, SamplingParams
from tinyvllm.scheduling.output import NewRequest, ScheduledRequest, SchedulerOutput
from tinyvllm.scheduling.request import EngineCoreRequest
from tinyvllm.worker import prompt_logprobs
from tinyvllm.worker.requests import apply_scheduler_output

from .test_model_runner import PROMPTS, loaded, make_engine, make_runner  # noqa: F401

PROMPT = PROMPTS[2]  # 13 tokens
P = len(PROMPT)
WITH_PLP = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
PLAIN = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def chunks(runner, sizes: list[int], blocks=(1, 2, 3, 4)) -> list[dict]:
    """Run request "a" (PROMPT, prompt_logprobs=2) in chunks of these sizes, beside a plain
    request "b" in the first step; each step's prompt logprobs."""
    results, start = [], 0
    for step_id, n in enumerate(sizes):
        out = SchedulerOutput(step_id=step_id, scheduled=[ScheduledRequest(
            "a", n, start, start + n >= P, new_block_ids=list(blocks) if start == 0 else [],
            block_offset=0 if start == 0 else len(blocks))])
        if step_id == 0:
            out.new_requests = [NewRequest("a", PROMPT, WITH_PLP), NewRequest("b", PROMPTS[1],
                                                                               PLAIN)]
            out.scheduled.append(ScheduledRequest("b", len(PROMPTS[1]), 0, True,
                                                  new_block_ids=[5, 6]))
        handle = runner.execute_async(out)
        handle.result()
        results.append(handle.prompt_logprobs)
        start += n
    return results


def flat(steps: list[dict]) -> list:
    return [lp for s in steps for lp in s.get("a", [])]


def test_chunks_score_every_prompt_token_once_whatever_the_chunking(loaded):
    whole = chunks(make_runner(loaded), [P])
    assert set(whole[0]) == {"a"}  # the plain request asked for nothing
    split = chunks(make_runner(loaded), [5, 1, 7])
    # Chunk [0, 5) scores tokens 1..5; [5, 6) token 6; [6, 13) tokens 7..12 (position 12 samples).
    assert [len(s["a"]) for s in split] == [6, 1, 6]
    a, b = flat(whole), flat(split)
    assert a[0] is None and b[0] is None and len(a) == len(b) == P
    assert [lp.token_id for lp in b[1:]] == PROMPT[1:]
    for x, y in zip(a[1:], b[1:]):
        assert y.logprob == pytest.approx(x.logprob, abs=1e-5)
        assert y.rank == x.rank and y.top_token_ids == x.top_token_ids
        assert len(y.top_logprobs) == 2 and y.top_logprobs[0] >= y.logprob - 1e-6
        assert (y.rank == 1) == (y.top_token_ids[0] == y.token_id)


def whole_prompt_logprobs(loaded) -> torch.Tensor:
    """log_softmax of the model's logits at every position of PROMPT, [P, vocab_size]."""
    runner = make_runner(loaded)
    out = SchedulerOutput(new_requests=[NewRequest("r", PROMPT, PLAIN)], scheduled=[
        ScheduledRequest("r", P, 0, True, new_block_ids=[1, 2, 3, 4])])
    inputs = runner._prepare_inputs(out, apply_scheduler_output(runner.requests, out, "cpu"))
    b = runner.buffers
    with torch.inference_mode():
        hidden = runner.model(b.input_ids_device(P), b.positions_device(P), runner.kv_caches,
                              inputs.meta)
        return torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)


def test_logprobs_are_log_softmax_of_the_positions_logits_in_pieces(loaded, monkeypatch):
    expected = whole_prompt_logprobs(loaded)
    monkeypatch.setattr(prompt_logprobs, "_PIECE_ELEMENTS", 3 * loaded.arch.vocab_size)
    rows_per_call = []
    compute_logits = loaded.model.compute_logits

    def counting(hidden):
        rows_per_call.append(hidden.shape[0])
        return compute_logits(hidden)
    monkeypatch.setattr(loaded.model, "compute_logits", counting)
    scored = flat(chunks(make_runner(loaded), [P]))
    # 12 prompt rows in pieces of 3, then the sampled rows (a's last position and b's).
    assert rows_per_call == [2, 3, 3, 3, 3]
    for i, lp in enumerate(scored[1:], 1):
        assert lp.logprob == pytest.approx(expected[i - 1, PROMPT[i]].item(), abs=1e-5)
        assert lp.top_logprobs[0] == pytest.approx(expected[i - 1].max().item(), abs=1e-5)
        assert lp.rank == int((expected[i - 1] > expected[i - 1, PROMPT[i]]).sum()) + 1


def test_recomputation_after_preemption_scores_nothing_again(loaded):
    runner = make_runner(loaded)
    first = chunks(runner, [8])
    assert len(first[0]["a"]) == 9
    # Preempted, then recomputed from position 0 up to the end of the prompt.
    handle = runner.execute_async(SchedulerOutput(
        step_id=1, preempted_request_ids=["a"],
        scheduled=[ScheduledRequest("a", P, 0, True, new_block_ids=[7, 8, 9, 10])]))
    handle.result()
    assert [lp.token_id for lp in handle.prompt_logprobs["a"]] == PROMPT[9:]


def test_one_token_prompt_reports_its_none(loaded):
    runner = make_runner(loaded)
    handle = runner.execute_async(SchedulerOutput(
        new_requests=[NewRequest("a", [7], WITH_PLP)],
        scheduled=[ScheduledRequest("a", 1, 0, True, new_block_ids=[1])]))
    assert handle.result()["a"][0] >= 0 and handle.prompt_logprobs == {"a": [None]}


def test_engine_reports_chunks_without_tokens_and_ignores_the_prefix_cache(loaded):
    engine = make_engine(loaded, max_num_batched_tokens=4, enable_prefix_caching=True)
    results = []
    for request_id in ("x", "y"):  # y is identical: x's blocks are cached by then
        engine.add_request(EngineCoreRequest(request_id, PROMPT, WITH_PLP))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        results.append(outs)
    for outs in results:
        prefill = [o for o in outs if not o.new_token_ids]
        assert len(prefill) == 3 and all(o.finish_reason is None for o in prefill)  # 4 + 4 + 4
        lps = [lp for o in outs for lp in o.new_prompt_logprobs or []]
        assert len(lps) == P and lps[0] is None
        assert [len(o.new_token_ids) for o in outs if o.new_token_ids] == [1, 1, 1]
        assert all(o.num_cached_tokens == 0 for o in outs)
    x, y = ([lp and lp.logprob for o in outs for lp in o.new_prompt_logprobs or []]
            for outs in results)
    assert x == y
    # The greedy tokens are those of a plain run.
    plain = make_engine(loaded)
    plain.add_request(EngineCoreRequest("p", PROMPT, PLAIN))
    tokens = []
    while plain.has_unfinished_requests():
        tokens += [t for o in plain.step() for t in o.new_token_ids]
    assert [t for o in results[0] for t in o.new_token_ids] == tokens


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5])
def test_invalid_prompt_logprobs_names_the_field(value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.field_name == "prompt_logprobs"
