"""Scheduler + KVCacheManager on CPU, without a model: exact block ids and token counts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.config import SchedulerConfig
from tinyvllm.scheduling.kv_cache_manager import KVCacheManager
from tinyvllm.scheduling.request import FinishReason, Request, RequestStatus
from tinyvllm.scheduling.scheduler import Scheduler
from tinyvllm.sampling_params import SamplingParams

BLOCK = 4


def make_scheduler(num_blocks=16, caching=True, **cfg):
    kv = KVCacheManager(num_blocks, BLOCK, caching, hash_seed=1)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len=1000)


def make_request(rid, n_prompt, max_tokens=4, start=100, params=None, **kw):
    return Request(request_id=rid, prompt_token_ids=list(range(start, start + n_prompt)),
                   sampling_params=params or SamplingParams(temperature=0, max_tokens=max_tokens),
                   eos_token_ids=frozenset({0}), **kw)


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = {x.request_id: (token, None) for x in out.scheduled if x.completes_sequence}
    return out, s.update(out, sampled)


def test_prefill_then_decode_exact_blocks():
    s = make_scheduler()
    r = make_request("a", 6, max_tokens=10)
    s.add_request(r)
    out, outputs = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 6)]
    assert s.kv.block_ids(r.request_id) == [1, 2]
    assert [o.new_token_ids for o in outputs] == [[7]]
    out, _ = run_step(s)
    assert out.scheduled[0].num_new_tokens == 1
    assert s.kv.block_ids(r.request_id) == [1, 2]  # position 6 fits in block 2
    run_step(s)
    assert s.kv.block_ids(r.request_id) == [1, 2]  # position 7 too
    run_step(s)
    assert s.kv.block_ids(r.request_id) == [1, 2, 3]  # position 8 opens block 3


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end():
    s = make_scheduler(max_num_batched_tokens=4)
    r = make_request("a", 10)
    s.add_request(r)
    chunks = []
    for _ in range(3):
        out, outputs = run_step(s)
        chunks.append(out.scheduled[0].num_new_tokens)
        if len(chunks) < 3:
            assert outputs == []
    assert chunks == [4, 4, 2]
    assert r.output_token_ids == [7]


def test_budget_shared_between_decode_and_new_prefill():
    s = make_scheduler(max_num_batched_tokens=5)
    a, b = make_request("a", 4), make_request("b", 8, start=500)
    s.add_request(a)
    run_step(s)
    s.add_request(b)
    out, _ = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 4)]


def test_max_tokens_finishes_and_frees_every_block():
    s = make_scheduler()
    r = make_request("a", 5, max_tokens=3)
    s.add_request(r)
    reasons = [run_step(s)[1][0].finish_reason for _ in range(3)]
    assert reasons == [None, None, FinishReason.LENGTH.value]
    assert r.status == RequestStatus.FINISHED
    assert s.kv.num_free_blocks == 15
    assert not s.has_unfinished_requests()


def test_eos_respects_min_tokens_and_ignore_eos():
    s = make_scheduler()
    r = make_request("a", 3, params=SamplingParams(temperature=0, max_tokens=10, min_tokens=2))
    s.add_request(r)
    assert run_step(s, token=0)[1][0].finish_reason is None  # EOS before min_tokens: ignored
    assert run_step(s, token=0)[1][0].finish_reason == "stop"


def test_stop_token_ids_report_stop_reason():
    s = make_scheduler()
    r = make_request("a", 3, params=SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[42]))
    s.add_request(r)
    out = run_step(s, token=42)[1][0]
    assert (out.finish_reason, out.stop_reason) == ("stop", 42)


def test_prefix_cache_hit_skips_cached_blocks_and_keeps_one_token():
    s = make_scheduler()
    a = make_request("a", 9, max_tokens=1)
    s.add_request(a)
    run_step(s)  # finishes; blocks 1, 2 (full) are published, block 3 partial
    b = make_request("b", 9, max_tokens=1)  # same prompt
    s.add_request(b)
    out, outputs = run_step(s)
    # 8 tokens (two full blocks) come from the cache; the 9th is computed.
    assert out.scheduled[0].num_new_tokens == 1
    assert b.num_cached_tokens == 8
    assert outputs[0].num_cached_tokens == 8
    assert s.kv.prefix_cache_hits == 8


def test_full_prompt_hit_is_capped_to_compute_one_token():
    s = make_scheduler()
    s.add_request(make_request("a", 8, max_tokens=1))
    run_step(s)
    b = make_request("b", 8, max_tokens=1)
    s.add_request(b)
    out, _ = run_step(s)
    assert b.num_cached_tokens == 4 and out.scheduled[0].num_new_tokens == 4


def test_cache_salt_isolates_tenants():
    s = make_scheduler()
    s.add_request(make_request("a", 9, max_tokens=1, cache_salt="tenant-1"))
    run_step(s)
    b = make_request("b", 9, max_tokens=1, cache_salt="tenant-2")
    s.add_request(b)
    run_step(s)
    assert b.num_cached_tokens == 0


def test_no_prefix_caching_means_no_hits():
    s = make_scheduler(caching=False)
    s.add_request(make_request("a", 9, max_tokens=1))
    run_step(s)
    b = make_request("b", 9, max_tokens=1)
    s.add_request(b)
    run_step(s)
    assert b.num_cached_tokens == 0


def test_preemption_recomputes_latest_request_and_it_still_finishes():
    # 5 usable blocks of 4 tokens; two requests of 8 prompt tokens need 2 blocks each, then grow.
    s = make_scheduler(num_blocks=6, caching=False)
    a, b = make_request("a", 8, max_tokens=6), make_request("b", 8, max_tokens=6, start=300)
    s.add_request(a)
    s.add_request(b)
    finished = {}
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        _, outputs = run_step(s)
        finished.update({o.request_id: o.finish_reason for o in outputs if o.finish_reason})
    assert finished == {"a": "length", "b": "length"}
    assert s.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.output_token_ids == b.output_token_ids == [7] * 6
    assert s.kv.num_free_blocks == 5


def test_preemption_keeps_the_rest_of_the_step():
    # 4 usable blocks, one per prompt: b's first decode needs a fifth, so d (the latest) is
    # preempted; c, after b and with room in its block, is still scheduled in that step.
    s = make_scheduler(num_blocks=5, caching=False)
    requests = [make_request(rid, n, start=100 * i) for i, (rid, n) in
                enumerate([("a", 2), ("b", 4), ("c", 2), ("d", 2)])]
    for r in requests:
        s.add_request(r)
    run_step(s)
    out, _ = run_step(s)
    assert out.preempted_request_ids == ["d"]
    assert [x.request_id for x in out.scheduled] == ["a", "b", "c"]
    assert [r.num_computed_tokens for r in requests] == [3, 5, 3, 0]
    assert all(r.num_output_placeholders == 0 for r in requests)


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 6), make_request("b", 6, start=200)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    assert s.num_running == 1 and s.num_waiting == 1
    s.abort_requests(["a", "b", "unknown"])
    assert s.kv.num_free_blocks == 15 and not s.has_unfinished_requests()
    assert a.finish_reason == FinishReason.ABORT
    assert set(s.schedule().finished_request_ids) == {"a", "b"}


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    low, high = make_request("low", 4, priority=5), make_request("high", 4, priority=0, start=50)
    s.add_request(low)
    s.add_request(high)
    out, _ = run_step(s)
    assert out.scheduled[0].request_id == "high"


def test_duplicate_request_id_is_rejected():
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(make_request("a", 4))


def test_the_step_message_carries_what_changed_only():
    """What a worker learns from the messages alone: a request whole once, then its new blocks
    at their offset; preempted ids lose their table and resume with a whole new one; finished
    ids go once; the message survives msgpack."""
    import msgspec

    from tinyvllm.scheduling.output import SchedulerOutput

    s = make_scheduler(num_blocks=6, caching=False)  # 5 usable blocks of 4 tokens
    finished = []

    def run_step(s):
        out, outputs = globals()["run_step"](s)
        finished.extend(out.finished_request_ids)
        return out, outputs

    s.add_request(make_request("a", 6, max_tokens=8))
    out, _ = run_step(s)
    assert [n.request_id for n in out.new_requests] == ["a"]
    assert out.new_requests[0].prompt_token_ids == list(range(100, 106))
    assert [(x.block_offset, x.new_block_ids, x.completes_sequence) for x in out.scheduled] == [
        (0, [1, 2], True)]
    out, _ = run_step(s)  # position 6: fits in block 2
    assert out.new_requests == [] and (out.scheduled[0].block_offset,
                                       out.scheduled[0].new_block_ids) == (2, [])
    out, _ = run_step(s)  # position 7
    out, _ = run_step(s)  # position 8 opens block 3
    assert (out.scheduled[0].block_offset, out.scheduled[0].new_block_ids) == (2, [3])
    s.add_request(make_request("b", 8, max_tokens=8, start=300))
    out, _ = run_step(s)  # b takes blocks 4, 5
    assert [n.request_id for n in out.new_requests] == ["b"]
    preempted = None
    for _ in range(8):  # the pool runs dry: b, the latest, is preempted
        out, _ = run_step(s)
        if out.preempted_request_ids:
            preempted = out
            break
    assert preempted is not None and preempted.preempted_request_ids == ["b"]
    assert "b" not in [x.request_id for x in preempted.scheduled]
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        resumed = [x for x in out.scheduled if x.request_id == "b"]
        if resumed:  # back with a whole table, not as a new request
            assert out.new_requests == [] and resumed[0].block_offset == 0
            assert len(resumed[0].new_block_ids) >= 2
            break
    while s.has_unfinished_requests():
        out, _ = run_step(s)
    finished += s.schedule().finished_request_ids
    assert sorted(finished) == ["a", "b"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput) == out


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 20), st.integers(0, 20), st.data())
def test_token_ids_between_slices_prompt_then_output(n_prompt, n_output, data):
    """A block's tokens for its hash, without the whole sequence concatenated."""
    r = make_request("r", n_prompt)
    r.output_token_ids.extend(range(500, 500 + n_output))
    whole = r.prompt_token_ids + r.output_token_ids
    start = data.draw(st.integers(0, len(whole)))
    end = data.draw(st.integers(start, len(whole)))
    assert r.token_ids_between(start, end) == whole[start:end]
