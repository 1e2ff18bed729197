"""Speculation on the scheduling side, without a model: the n-gram proposer, the config, and the
scheduler's allocation and rollback of draft tokens' KV (exact block ids and counts)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from tinyvllm.scheduling.kv_cache_manager import KVCacheManager
from tinyvllm.scheduling.request import Request
from tinyvllm.scheduling.scheduler import Scheduler
from tinyvllm import _core
from tinyvllm.scheduling.spec_decode import (NgramProposer, SpecDecodePolicy, SpecDecodeStats,
                                             ngram_propose_ref)
from tinyvllm.sampling_params import SamplingParams

BLOCK = 4


def propose(tokens, k=4, min_n=1, max_n=3):
    return NgramProposer(min_n, max_n).propose(np.array(tokens, dtype=np.int64), k)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    # suffix [2, 3] occurs at 1..2 (then 9, 9) and at 5..6 (then 4, 5): the latest wins.
    assert propose([1, 2, 3, 9, 9, 2, 3, 4, 5, 7, 2, 3]) == [4, 5, 7, 2]
    # [8, 2, 3] (n = 3) beats the later [2, 3] match.
    assert propose([8, 2, 3, 6, 6, 1, 2, 3, 7, 8, 2, 3]) == [6, 6, 1, 2]
    assert propose([8, 2, 3, 6, 6, 1, 2, 3, 7, 8, 2, 3], k=2) == [6, 6]
    # The continuation stops at the end of the sequence.
    assert propose([5, 6, 7, 5, 6]) == [7, 5, 6]
    # Periodic: the latest match is followed by one period only, the earliest by k tokens.
    assert propose([1, 2, 1, 2, 1, 2], max_n=2) == [1, 2, 1, 2]
    assert propose([1, 2, 1, 2, 1, 2], k=2, max_n=2) == [1, 2]


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), min_n=st.integers(1, 4),
       extra_n=st.integers(0, 3), k=st.integers(-1, 9))
def test_ngram_matcher_follows_the_reference_rule(tokens, min_n, extra_n, k):
    """The C++ matcher proposes what the numpy statement of the rule does, on small alphabets
    (many matches of every length, periodic runs, ties between ends)."""
    ids = np.array(tokens, dtype=np.int64)
    max_n = min_n + extra_n
    assert _core.ngram_propose(ids, min_n, max_n, k) == ngram_propose_ref(ids, min_n, max_n, k)


def test_ngram_matcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="1-D"):
        _core.ngram_propose(np.zeros((2, 2), dtype=np.int64), 1, 2, 3)
    with pytest.raises(ValueError, match="min_n=3, max_n=2"):
        _core.ngram_propose(np.zeros(4, dtype=np.int64), 3, 2, 3)
    # Other integer arrays are converted.
    assert _core.ngram_propose(np.array([1, 2, 1], dtype=np.int32), 1, 2, 2) == [2, 1]


def test_ngram_no_match_or_too_short():
    assert propose([1, 2, 3, 4]) == []
    assert propose([7]) == []
    assert propose([1, 2, 3, 1, 2], min_n=3) == []  # only n = 2 matches
    assert propose([1, 2, 3, 1, 2], min_n=2) == [3, 1, 2]
    assert propose([1, 2, 1, 2], k=0) == []


def test_stats_count_per_position():
    stats = SpecDecodeStats()
    stats.observe(4, 2)
    stats.observe(3, 3)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 5)
    assert stats.accepted_per_position == [2, 2, 1, 0]
    assert stats.acceptance_rate == 5 / 9 and stats.mean_accepted_length == 1 + 5 / 3


def test_config_parses_json_and_names_bad_keys():
    config = EngineConfig.from_kwargs(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 3
    assert not EngineConfig.from_kwargs().speculative.enabled
    with pytest.raises(TypeError, match="unknown key 'num_spec_tokens'"):
        SpeculativeConfig.parse({"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.parse({"method": "medusa"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match="num_speculative_tokens must be positive"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 0})


def make_scheduler(num_blocks=16, k=4, **spec):
    kv = KVCacheManager(num_blocks, BLOCK, True, hash_seed=1)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, **spec)
    return Scheduler(SchedulerConfig(), kv, max_model_len=1000, speculative=config)


def make_request(rid, prompt, max_tokens=20):
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
                   eos_token_ids=frozenset({0}))


def test_draft_slots_are_allocated_then_rolled_back():
    s = make_scheduler(adaptive=False)
    r = make_request("a", [1, 2, 3, 4, 1, 2])
    s.add_request(r)
    out = s.schedule()
    s.update(out, {"a": (3, None)})  # prefill samples 3: tokens 1 2 3 4 1 2 3
    free_before = s.kv.num_free_blocks
    out = s.schedule()
    (step,) = out.scheduled
    # suffix [1, 2, 3] matched at 0..2: the draft is 4 1 2 3, at positions 7..10.
    assert step.draft_token_ids == [4, 1, 2, 3] and step.num_new_tokens == 5
    assert r.num_computed_tokens == 11 and s.kv.block_ids(r.request_id) == [1, 2, 3]
    # The target accepts 4 and 1, then says 9: positions 7..8 kept, 9..10 rolled back.
    (result,) = s.update(out, {"a": ([4, 1, 9], None)})
    assert result.new_token_ids == [4, 1, 9]
    assert r.output_token_ids == [3, 4, 1, 9]
    assert r.num_computed_tokens == 9 and r.num_tokens == 10
    assert s.kv.block_ids(r.request_id) == [1, 2, 3]  # position 8 is in block 3
    assert s.kv.num_published_blocks(r.request_id) == 2  # positions 0..7: only accepted tokens' full blocks
    assert s.kv.num_free_blocks == free_before - 1
    assert s.spec.stats.num_accepted_tokens == 2 and s.spec.stats.num_draft_tokens == 4


def test_rejected_drafts_blocks_are_freed():
    s = make_scheduler(adaptive=False)
    r = make_request("a", [5, 6, 7, 8, 5, 6, 7])
    s.add_request(r)
    s.update(s.schedule(), {"a": (8, None)})  # 8 tokens: blocks 1, 2 full
    out = s.schedule()
    assert out.scheduled[0].draft_token_ids == [5, 6, 7, 8]
    assert s.kv.block_ids(r.request_id) == [1, 2, 3]  # positions 7..11
    s.update(out, {"a": ([1], None)})  # the first draft is rejected
    assert r.num_computed_tokens == 8 and s.kv.block_ids(r.request_id) == [1, 2]
    assert s.kv.num_free_blocks == s.kv.num_blocks - 1 - 2


def test_draft_is_capped_by_max_tokens_and_the_budget():
    s = make_scheduler()
    r = make_request("a", [1, 2, 1, 2, 1, 2, 1, 2], max_tokens=3)
    s.add_request(r)
    s.update(s.schedule(), {"a": (1, None)})
    out = s.schedule()
    # 1 output token so far, 3 at most: this step may yield 2, so 1 draft.
    assert out.scheduled[0].draft_token_ids == [2]
    s.update(out, {"a": ([2, 1], None)})
    assert r.is_finished and r.output_token_ids == [1, 2, 1]
    assert s.kv.num_free_blocks == s.kv.num_blocks - 1


def test_adaptive_k_shrinks_after_rejections_and_grows_back():
    policy = SpecDecodePolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    k, ks = 4, []
    for accepted in (0, 0, 0, 0, 1, 1, 2, 2, 4):  # of min(k, ...) drafts
        k = policy.next_k(k, k, min(accepted, k))
        ks.append(k)
    assert ks == [3, 2, 1, 1, 2, 2, 3, 3, 4]
    fixed = SpecDecodePolicy(SpeculativeConfig(method="ngram", adaptive=False))
    assert fixed.next_k(4, 4, 0) == 4


def test_one_token_drafts_that_miss_make_the_request_skip_drafting_for_longer_each_time():
    policy = SpecDecodePolicy(SpeculativeConfig(method="ngram"))
    request = Request(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams())
    policy.back_off(request, 3, 0)  # k still shrinking: no pause
    assert request.spec_skip == 0
    skips = []
    for _ in range(7):
        policy.back_off(request, 1, 0)
        skips.append(request.spec_skip)
    assert skips == [1, 2, 4, 8, 16, 16, 16]
    policy.back_off(request, 1, 1)  # an accepted token resets the run of misses
    policy.back_off(request, 1, 0)
    assert request.spec_skip == 1
    fixed = SpecDecodePolicy(SpeculativeConfig(method="ngram", adaptive=False))
    other = Request(request_id="s", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams())
    fixed.back_off(other, 1, 0)
    assert other.spec_skip == 0
    draft = SpecDecodePolicy(SpeculativeConfig(method="draft_model", draft_num_layers=1))
    draft.back_off(other, 1, 0)  # a draft model's misses are not prompt lookup's
    assert other.spec_skip == 0


def test_speculation_steps_aside_while_it_does_not_pay_and_comes_back():
    policy = SpecDecodePolicy(SpeculativeConfig(method="ngram"))
    cost = policy.cost
    assert policy.active(1)
    for _ in range(cost.MIN_SAMPLES):
        policy.observe_step(0.1, 1, speculated=False)  # 10 tokens/s
    for _ in range(cost.MIN_SAMPLES - 1):
        policy.observe_step(0.4, 2, speculated=True)  # 5 tokens/s: not decided yet
        assert policy.active(1)
    policy.observe_step(0.4, 2, speculated=True)
    assert not policy.active(1)
    for _ in range(cost.OFF_STEPS - 1):
        policy.observe_step(0.1, 1, speculated=False)
        assert not policy.active(1)
    policy.observe_step(0.1, 1, speculated=False)
    assert policy.active(1)  # tried again; now it pays
    for _ in range(2 * cost.WINDOW):
        policy.observe_step(0.2, 3, speculated=True)  # 15 tokens/s
    assert policy.active(1)


def test_speculation_that_keeps_losing_steps_aside_longer_each_time():
    """Each loss in a row doubles the pause (capped), so text on which speculation never pays
    spends few steps on trials; a win resets it."""
    policy = SpecDecodePolicy(SpeculativeConfig(method="ngram"))
    cost = policy.cost

    def lose() -> int:  # a trial that loses; returns the pause that follows it
        for _ in range(cost.WINDOW):
            policy.observe_step(0.4, 2, speculated=True)  # 5 tokens/s
            if not policy.active(1):
                break
        pause = 0
        while not policy.active(1):
            policy.observe_step(0.1, 1, speculated=False)  # 10 tokens/s
            pause += 1
        return pause

    for _ in range(cost.MIN_SAMPLES):
        policy.observe_step(0.1, 1, speculated=False)
    pauses = [lose() for _ in range(cost.MAX_BACKOFF + 2)]
    assert pauses == [cost.OFF_STEPS << min(i, cost.MAX_BACKOFF) for i in range(len(pauses))]
    for _ in range(cost.MIN_SAMPLES):
        policy.observe_step(0.2, 3, speculated=True)  # 15 tokens/s: a win
    assert policy.active(1) and cost.losses == 0
    assert lose() == cost.OFF_STEPS


def test_speculation_compares_window_totals_not_single_steps():
    """Tokens over time of the window: rejections in a row (1 token a step) among accepted
    steps do not stop speculation that pays overall."""
    policy = SpecDecodePolicy(SpeculativeConfig(method="ngram"))
    for _ in range(policy.cost.WINDOW):
        policy.observe_step(0.1, 1, speculated=False)  # 10 tokens/s
    for tokens in [1, 1, 1, 5, 5, 1, 1, 1, 5, 5, 1, 1, 1]:  # 2.5 a step on average
        policy.observe_step(0.12, tokens, speculated=True)  # 1 token: 8.3 tokens/s
        assert policy.active(1)
    assert policy.cost.rate(True) > policy.cost.rate(False)


def test_speculation_without_plain_steps_steps_aside_once_to_measure_them():
    """A batch in which every step speculates: after a window of such steps, plain steps are
    measured (a pause); speculation then stays only if it beats them."""
    policy = SpecDecodePolicy(SpeculativeConfig(method="ngram"))
    cost = policy.cost
    for _ in range(cost.WINDOW - 1):
        policy.observe_step(0.2, 2, speculated=True)  # 10 tokens/s
        assert policy.active(8)
    policy.observe_step(0.2, 2, speculated=True)
    assert not policy.active(8)  # stepping aside to measure plain steps: a short pause
    assert cost.MIN_SAMPLES <= cost.MEASURE_STEPS < cost.OFF_STEPS
    for _ in range(cost.MEASURE_STEPS):
        policy.observe_step(0.05, 1, speculated=False)  # 20 tokens/s
    assert policy.active(8)
    policy.observe_step(0.2, 2, speculated=True)  # the window it already has decides
    assert not policy.active(8)  # slower than plain decoding: aside again, for longer
    for _ in range(cost.OFF_STEPS - 1):
        policy.observe_step(0.05, 1, speculated=False)
        assert not policy.active(8)


def test_speculation_that_pays_keeps_running_after_measuring_plain_steps():
    policy = SpecDecodePolicy(SpeculativeConfig(method="ngram"))
    cost = policy.cost
    for _ in range(cost.WINDOW):
        policy.observe_step(0.1, 3, speculated=True)  # 30 tokens/s
    for _ in range(cost.MEASURE_STEPS):
        assert not policy.active(1)
        policy.observe_step(0.05, 1, speculated=False)  # 20 tokens/s
    for _ in range(4 * cost.WINDOW):
        assert policy.active(1)
        policy.observe_step(0.1, 3, speculated=True)


def test_waiting_requests_count_toward_disable_by_batch_size():
    """A batch still filling (requests waiting for a slot) is the batch it will be: with
    disable_by_batch_size 3, two running and one waiting do not speculate."""
    kv = KVCacheManager(64, BLOCK, True, hash_seed=1)
    s = Scheduler(SchedulerConfig(max_num_seqs=2), kv, max_model_len=1000,
                  speculative=SpeculativeConfig(method="ngram", disable_by_batch_size=3))
    repeating = [7, 8, 9, 7, 8, 9, 7, 8]  # prompt lookup finds a draft for it
    for i in range(3):
        s.add_request(make_request(str(i), repeating))
    s.update(s.schedule(), {"0": (9, None), "1": (9, None)})
    assert len(s.running) == 2 and len(s.waiting) == 1
    assert s.can_schedule_ahead()
    assert all(not r.draft_token_ids for r in s.schedule().scheduled)


def test_steps_are_scheduled_ahead_only_while_speculation_steps_aside():
    """Active speculation needs each step's tokens before the next is scheduled; at a batch of
    disable_by_batch_size or more, and during a pause (drafts that do not pay), steps are
    scheduled ahead again, and the pause counts the steps that were only counted (duration 0).
    Every sampled token is new, so no n-gram matches and every step is a plain one."""
    s = make_scheduler(num_blocks=64, disable_by_batch_size=3)
    for i in range(2):
        s.add_request(make_request(str(i), [10 + i, 20 + i, 30 + i]))
    s.update(s.schedule(), {"0": (100, None), "1": (101, None)})
    assert not s.can_schedule_ahead()  # 2 running, speculation active
    s.add_request(make_request("2", [40, 50, 60]))
    s.update(s.schedule(), {str(i): (110 + i, None) for i in range(3)})
    assert len(s.running) == 3 and s.can_schedule_ahead()  # 3 running: it steps aside

    s = make_scheduler(num_blocks=64)
    s.add_request(make_request("a", [10, 20, 30]))
    s.update(s.schedule(), {"a": (100, None)})
    s.spec.cost.off_steps_left = 2  # a pause, as after drafts that did not pay
    assert s.can_schedule_ahead()
    s.spec.observe_step(0.0, 1, speculated=False)
    assert s.can_schedule_ahead()
    s.spec.observe_step(0.0, 1, speculated=False)
    assert not s.can_schedule_ahead()


def test_a_request_pausing_its_drafts_lets_steps_be_scheduled_ahead():
    """While the only request that could speculate pauses its prompt-lookup drafts (after
    one-token drafts that missed), nothing needs a step's tokens before the next is scheduled:
    steps run ahead, the pause counts down in them, and once it ends steps are synchronous
    again and the request drafts."""
    s = make_scheduler(num_blocks=64)
    r = make_request("a", [7, 8, 9, 7, 8, 9, 7, 8])
    s.add_request(r)
    s.update(s.schedule(), {"a": (9, None)})
    assert not s.can_schedule_ahead()  # it could draft
    r.spec_skip = 2  # as `SpecDecodePolicy.back_off` sets it after a miss
    assert s.can_schedule_ahead()
    first = s.schedule()
    assert first.scheduled[0].draft_token_ids == [] and r.spec_skip == 1
    assert s.can_schedule_ahead()
    second = s.schedule()  # scheduled ahead: its input token is still in flight
    assert second.scheduled[0].draft_token_ids == [] and r.spec_skip == 0
    assert not s.can_schedule_ahead()  # the pause is over: the next step waits for these
    s.update(first, {"a": (7, None)})
    s.update(second, {"a": (8, None)})
    assert r.output_token_ids == [9, 7, 8]
    assert s.schedule().scheduled[0].draft_token_ids == [9, 7, 8, 9]


def test_under_async_scheduling_lookups_that_match_nothing_pause_and_steps_run_ahead():
    """With steps scheduled ahead, a prompt lookup that matches nothing pauses the request's
    lookups for 1, 2, 4 ... steps (capped), so its plain steps run ahead; a match resets the
    pause. Without scheduling ahead there is no pause."""
    s = make_scheduler(num_blocks=64)
    s.spec.pause_without_match = True
    r = make_request("a", [10, 20, 30], max_tokens=100)
    s.add_request(r)
    s.update(s.schedule(), {"a": (100, None)})
    pauses, token = [], 200
    for _ in range(24):  # every token is new: nothing ever matches
        ahead = s.can_schedule_ahead()
        out = s.schedule()
        assert out.scheduled[0].draft_token_ids == []
        if not ahead:  # a step that looked up: the pause it set
            pauses.append(r.spec_skip)
        s.update(out, {"a": (token, None)})
        token += 1
    assert pauses[:5] == [1, 2, 4, 8, 8]
    # A repeated suffix matches at the next lookup and ends the pause.
    r.spec_skip = 100
    s.update(s.schedule(), {"a": (100, None)})
    s.update(s.schedule(), {"a": (200, None)})  # ... 100, 200 occurred before: a match
    r.spec_skip = 0
    assert s.schedule().scheduled[0].draft_token_ids and r.spec_no_match == 0

    plain = make_scheduler(num_blocks=64)  # pause_without_match off (the CPU)
    q = make_request("b", [10, 20, 30])
    plain.add_request(q)
    plain.update(plain.schedule(), {"b": (100, None)})
    assert plain.schedule().scheduled[0].draft_token_ids == [] and q.spec_skip == 0



def behind_scheduler(max_tokens=20, **spec):
    """A scheduler as the engine sets it up under async scheduling in one process, and a
    request whose prefill is in flight: its prompt ends in "10 1", which never occurred before
    (prompt_lookup_min 2), while "1 2" continues 3 4 5 6 7."""
    s = make_scheduler(num_blocks=64, adaptive=False, prompt_lookup_min=2, prompt_lookup_max=3,
                       **spec)
    s.spec.schedule_ahead(async_scheduling=True, tensor_parallel_size=1)
    r = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1], max_tokens=max_tokens)
    s.add_request(r)
    return s, r


@pytest.mark.parametrize("in_flight", [3, 9], ids=["guessed", "missed"])
def test_prompt_lookup_drafts_behind_a_token_in_flight(in_flight):
    """With a plain step in flight, the next step is scheduled ahead and drafts from the known
    tokens: the match's continuation past the token in flight, which row 0 takes from the
    device. A right guess lets the drafts be accepted; after a wrong one the target's own token
    at row 0 is kept and the drafts' KV rolled back."""
    s, r = behind_scheduler()
    prefill = s.schedule()
    assert s.can_schedule_ahead()
    decode = s.schedule()  # behind the prefill's token: "10 1" matches nothing
    assert decode.scheduled[0].draft_token_ids == [] and r.num_output_placeholders == 2
    s.update(prefill, {"a": (2, None)})  # ... 10 1 2
    assert s.can_schedule_ahead()
    verify = s.schedule()  # behind decode's token: "1 2" -> 3 4 5 6 7, the 3 in flight
    (v,) = verify.scheduled
    assert v.draft_token_ids == [4, 5, 6, 7] and v.num_new_tokens == 5
    assert v.num_computed_tokens == 12 and r.num_output_placeholders == 2
    s.update(decode, {"a": (in_flight, None)})
    target = [4, 5, 6, 7, 8] if in_flight == 3 else [5]
    (result,) = s.update(verify, {"a": (target, None)})
    assert result.new_token_ids == target
    assert r.output_token_ids == [2, in_flight] + target
    assert r.num_output_placeholders == 0
    # Computed: the prompt, 2, the token in flight and the accepted drafts (not the last one).
    assert r.num_computed_tokens == r.num_tokens - 1
    assert len(s.kv.block_ids("a")) == -(-r.num_computed_tokens // BLOCK)
    assert s.spec.stats.num_accepted_tokens == (4 if in_flight == 3 else 0)
    assert s.can_schedule_ahead()


def test_drafts_behind_a_token_in_flight_leave_room_for_it():
    """max_tokens counts the token in flight: 4 at most, one sampled and one in flight, so a
    verification behind it may yield 2 (1 draft)."""
    s, r = behind_scheduler(max_tokens=4)
    prefill = s.schedule()
    decode = s.schedule()
    s.update(prefill, {"a": (2, None)})
    verify = s.schedule()
    assert verify.scheduled[0].draft_token_ids == [4]
    s.update(decode, {"a": (3, None)})
    s.update(verify, {"a": ([4, 5], None)})
    assert r.is_finished and r.output_token_ids == [2, 3, 4, 5]
    assert s.kv.num_free_blocks == s.kv.num_blocks - 1


def test_drafting_behind_needs_prompt_lookup_async_scheduling_and_one_process():
    """Drafts behind a token in flight need scheduling ahead, a proposer that needs no step
    (a draft model drafts after the step), and a verification whose result may be taken after
    the next step's launch (tensor-parallel ranks take it inside the step). Otherwise lookups
    that match nothing pause under async scheduling, as before."""
    ngram = SpecDecodePolicy(SpeculativeConfig(method="ngram"))
    draft = SpecDecodePolicy(SpeculativeConfig(method="draft_model", draft_num_layers=1))
    for policy, async_, tp, behind, pause in (
            (ngram, True, 1, True, False), (ngram, True, 2, False, True),
            (ngram, False, 1, False, False), (draft, True, 1, False, True)):
        policy.schedule_ahead(async_, tp)
        assert (policy.drafts_behind, policy.pause_without_match) == (behind, pause)


def verification_in_flight(temperature=0.0):
    """A scheduler (drafting behind on) whose request verifies 3 4 5 6 after "1 2" at positions
    11..15 (row 0: the 2 at 11), in flight."""
    s = make_scheduler(num_blocks=64, adaptive=False, prompt_lookup_min=2, prompt_lookup_max=3)
    s.spec.schedule_ahead(async_scheduling=True, tensor_parallel_size=1)
    r = Request(request_id="a", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1],
                sampling_params=SamplingParams(temperature=temperature, seed=3, max_tokens=40),
                eos_token_ids=frozenset({0}))
    s.add_request(r)
    s.update(s.schedule(), {"a": (2, None)})
    verify = s.schedule()
    assert verify.scheduled[0].draft_token_ids == [3, 4, 5, 6]
    assert not s.can_schedule_ahead()  # no verification of it has accepted every draft yet
    r.spec_streak = 1  # as after one that did
    return s, r, verify


@pytest.mark.parametrize("all_accepted", [True, False], ids=["all_accepted", "fell_short"])
def test_a_step_behind_a_verification_assumes_every_draft_accepted(all_accepted):
    """A greedy verification in flight lets the next step be scheduled ahead: the request's
    next input is the verification's last token (position 16 if all four drafts are accepted),
    its drafts follow the assumed ones (... 3 4 5 6 | 7 in flight -> 8 9 10 1). If they are all
    accepted, that step stands; if not, its work for the request is dropped when it comes, the
    request's KV is rolled back to the tokens it has, and it is left out of the steps until
    then."""
    s, r, verify = verification_in_flight()
    assert s.can_schedule_ahead()
    behind = s.schedule()
    (b,) = behind.scheduled
    assert b.num_computed_tokens == 16 and b.draft_token_ids == [8, 9, 10, 1]
    assert r.num_computed_tokens == 21 and r.num_output_placeholders == 2
    if all_accepted:
        (out,) = s.update(verify, {"a": ([3, 4, 5, 6, 7], None)})
        assert out.new_token_ids == [3, 4, 5, 6, 7] and r.num_computed_tokens == 21
        (out,) = s.update(behind, {"a": ([8, 9, 11], None)})
        assert out.new_token_ids == [8, 9, 11]
        assert r.output_token_ids == [2, 3, 4, 5, 6, 7, 8, 9, 11]
        assert r.num_computed_tokens == r.num_tokens - 1 == 19
        assert len(s.kv.block_ids("a")) == 5
    else:
        (out,) = s.update(verify, {"a": ([3, 4, 9], None)})
        assert out.new_token_ids == [3, 4, 9]
        assert r.num_computed_tokens == r.num_tokens - 1 == 14
        assert len(s.kv.block_ids("a")) == 4  # the assumed step's blocks freed
        # The step in flight verifies for a request whose last verification fell short.
        assert not s.can_schedule_ahead()
        assert s.schedule().is_empty  # (and the request is left out while it is in flight)
        assert s.update(behind, {"a": ([8, 9, 10, 1, 5], None)}) == []  # dropped
        assert r.output_token_ids == [2, 3, 4, 9] and r.num_output_placeholders == 0
        (again,) = s.schedule().scheduled  # scheduled again from the tokens it has
        assert again.num_computed_tokens == 14


def test_a_sampled_verification_in_flight_keeps_the_next_step_waiting():
    s, r, verify = verification_in_flight(temperature=1.0)
    assert not s.can_schedule_ahead()


def test_verifications_count_their_streak_of_fully_accepted_drafts():
    s, r, verify = verification_in_flight()
    r.spec_streak = 0
    s.update(verify, {"a": ([3, 4, 5, 6, 7], None)})
    assert r.spec_streak == 1
    again = s.schedule()  # ... 3 4 5 6 7: "5 6 7" -> 8 9 10 1
    assert again.scheduled[0].draft_token_ids == [8, 9, 10, 1]
    s.update(again, {"a": ([8, 2], None)})
    assert r.spec_streak == 0


def test_a_verification_in_flight_that_meets_a_stop_drops_the_step_behind_it():
    """EOS among the accepted tokens finishes the request; the step behind is dropped and every
    block is back."""
    s, r, verify = verification_in_flight()
    behind = s.schedule()
    (out,) = s.update(verify, {"a": ([3, 0], None)})
    assert out.finish_reason is not None and r.is_finished
    assert s.update(behind, {"a": ([8, 9], None)}) == []
    assert s.kv.num_free_blocks == s.kv.num_blocks - 1
