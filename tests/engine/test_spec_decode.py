"""Speculative decoding in the engine: the same tokens with speculation on as off, and no KV
block leaked.

The tiny random model runs every sampling kind and engine shape; the bundled SmolLM2 runs the
acceptance cases (greedy, alone and in a mixed batch with chunked prefill, with prefix caching,
under preemption) on prompts that it continues by quoting, so that drafts are accepted.
"""

from __future__ import annotations

import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import UniProcExecutor
from tinyvllm.scheduling.request import EngineCoreRequest
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner

from .conftest import assert_all_blocks_free

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
TINY_PROMPTS = [[5, 17, 99, 3, 5, 17, 99, 3, 5, 17, 99, 3, 5], [9, 8, 7, 6, 5],
                [100, 200, 150, 10, 11, 12, 100, 200, 150, 10, 11, 12, 100, 200, 19]]
MAX_TOKENS = 16


def make_engine(loaded, spec=None, **kwargs) -> EngineCore:
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32", speculative_config=spec,
                                      **kwargs)
    return EngineCore(config, UniProcExecutor(config, ModelRunner(config, loaded=loaded)))


def generate(engine: EngineCore, prompts, params) -> list[list[int]]:
    """Run to completion; per prompt its tokens. Asserts that no token follows a finish and that
    every block is back in the pool."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, per_prompt)):
        engine.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=ids,
                                             sampling_params=p))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished.add(out.request_id)
    assert finished == set(tokens)
    assert_all_blocks_free(engine)
    return [tokens[str(i)] for i in range(len(prompts))]


# --- the tiny random model: every sampling kind, every engine shape ----------------------------

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234,
                             max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded_min_p": SamplingParams(temperature=0.7, min_p=0.05, seed=7, max_tokens=MAX_TOKENS,
                                   ignore_eos=True),
    # Never speculate (they read output ids on the host, or ask for logprobs): still the same.
    "logprobs": SamplingParams(temperature=0.0, logprobs=2, max_tokens=MAX_TOKENS,
                               ignore_eos=True),
    "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=MAX_TOKENS,
                                ignore_eos=True),
}
ENGINES = {"batched": {}, "chunked": {"max_num_batched_tokens": 7},
           "preempting": {"num_kv_blocks": 12}, "no_prefix_caching":
           {"enable_prefix_caching": False},
           # steps scheduled ahead while speculation or a request's drafts pause
           "async": {"async_scheduling": True}}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


@pytest.mark.parametrize("engine_kwargs", ENGINES.values(), ids=ENGINES.keys())
@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_tiny_same_tokens_with_speculation(tiny, params, engine_kwargs):
    kwargs = {"block_size": 4, "num_kv_blocks": 64, **engine_kwargs}
    off = generate(make_engine(tiny, **kwargs), TINY_PROMPTS, params)
    engine = make_engine(tiny, NGRAM, **kwargs)
    assert generate(engine, TINY_PROMPTS, params) == off
    stats = engine.get_stats()
    if params.logprobs is None and params.repetition_penalty == 1.0:
        # Scheduling ahead, lookups that match nothing pause: the random model's sampled
        # outputs may then leave no lookup that matches in 16 tokens.
        assert stats.spec_num_draft_tokens > 0 or (engine.async_scheduling
                                                   and not params.greedy)
    else:
        assert stats.spec_num_draft_tokens == 0
    if engine_kwargs.get("num_kv_blocks"):
        assert engine.scheduler.num_preemptions > 0


def test_tiny_mixed_sampling_kinds_in_one_batch(tiny):
    params = list(PARAMS.values())[:len(TINY_PROMPTS)]
    off = generate(make_engine(tiny, block_size=4), TINY_PROMPTS, params)
    assert generate(make_engine(tiny, NGRAM, block_size=4), TINY_PROMPTS, params) == off


def test_tiny_stop_token_among_accepted_drafts_ends_the_output_there(tiny):
    greedy = PARAMS["greedy"]
    full = generate(make_engine(tiny, NGRAM), TINY_PROMPTS[:1], greedy)[0]
    stop = full[6]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop])
    engine = make_engine(tiny, NGRAM)
    out = generate(engine, TINY_PROMPTS[:1], params)[0]
    assert out == full[:full.index(stop) + 1]


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_tiny_max_tokens_is_never_passed(tiny, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    off = generate(make_engine(tiny), TINY_PROMPTS, params)
    on = generate(make_engine(tiny, NGRAM), TINY_PROMPTS, params)
    assert on == off and all(len(t) == max_tokens for t in on)


def test_tiny_speculation_steps_aside_for_large_batches(tiny):
    engine = make_engine(tiny, {**NGRAM, "disable_by_batch_size": 1})
    generate(engine, TINY_PROMPTS, PARAMS["greedy"])
    assert engine.get_stats().spec_num_draft_tokens == 0
    # At the limit of 3 it steps aside until the first request (max_tokens 2) has finished.
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    params = [short, PARAMS["greedy"], PARAMS["greedy"]]
    off = generate(make_engine(tiny), TINY_PROMPTS, params)
    engine = make_engine(tiny, {**NGRAM, "disable_by_batch_size": 3})
    assert generate(engine, TINY_PROMPTS, params) == off
    assert engine.get_stats().spec_num_draft_tokens > 0


def spy_drafts_behind(engine: EngineCore) -> dict[str, int]:
    """Counts, as the run goes: verifications that draft behind a plain token in flight (row 0
    one past the tokens the scheduler knows), and steps of a request scheduled behind its
    verification in flight (further past: its drafts assumed accepted)."""
    counts = {"drafts_behind": 0, "behind_verification": 0}
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        for s in out.scheduled:
            past = s.num_computed_tokens - engine.scheduler.requests[s.request_id].num_tokens
            if past == 0 and s.draft_token_ids:
                counts["drafts_behind"] += 1
            elif past > 0:
                counts["behind_verification"] += 1
        return out
    engine.scheduler.schedule = spy
    return counts


@pytest.mark.parametrize("params", [PARAMS["greedy"], PARAMS["seeded"]], ids=["greedy", "seeded"])
def test_tiny_async_drafts_behind_tokens_in_flight(tiny, params):
    """Under async scheduling, prompt lookup drafts behind a token in flight: the same tokens
    as without speculation, no block leaked. (Steps behind a verification in flight need
    drafts that keep being accepted, which the random model's text seldom gives: the bundled
    model's test below has them.)"""
    kwargs = {"block_size": 4, "num_kv_blocks": 64, "async_scheduling": True}
    off = generate(make_engine(tiny, **kwargs), TINY_PROMPTS, params)
    engine = make_engine(tiny, NGRAM, **kwargs)
    counts = spy_drafts_behind(engine)
    assert generate(engine, TINY_PROMPTS, params) == off
    assert counts["drafts_behind"] > 0
    if not params.greedy:
        assert counts["behind_verification"] == 0


# --- the bundled model: the acceptance cases -------------------------------------------------

QUOTE = ("Copy the following code exactly.\n\n"
         "def area(width, height):\n    return width * height\n\n"
         "def perimeter(width, height):\n    return 2 * (width + height)\n\nCopy:\n\n")
OTHER = "The three primary colors are"


@pytest.fixture(scope="module")
def real_prompts(smollm2_model) -> list[list[int]]:
    tok = smollm2_model.tokenizer
    return [tok.encode(QUOTE), tok.encode(OTHER), tok.encode(QUOTE + "def area")]


@pytest.fixture(scope="module")
def real_off(smollm2_model, real_prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return generate(make_engine(smollm2_model), real_prompts, params)


@pytest.mark.slow
def test_real_alone_greedy_identical_and_drafts_accepted(smollm2_model, real_prompts, real_off):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = make_engine(smollm2_model, NGRAM)
    # The prompt whose greedy continuation quotes its own code (the first one's does not).
    assert generate(engine, real_prompts[2:], params) == real_off[2:]
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0
    assert sum(stats.spec_num_accepted_per_position) == stats.spec_num_accepted_tokens


REAL_ENGINES = {
    # Prompts are chunked while another request speculates: both in one step's budget.
    "mixed_chunked": {"max_num_batched_tokens": 24},
    # 9 blocks of 16 for three requests of up to ~100 tokens: preemption.
    "preempting": {"num_kv_blocks": 10, "block_size": 16},
    # Steps scheduled ahead, drafts behind tokens in flight (as on a GPU).
    "async": {"async_scheduling": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("engine_kwargs", REAL_ENGINES.values(), ids=REAL_ENGINES.keys())
def test_real_batch_greedy_identical(smollm2_model, real_prompts, real_off, engine_kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = make_engine(smollm2_model, NGRAM, **engine_kwargs)
    counts = spy_drafts_behind(engine)
    assert generate(engine, real_prompts, params) == real_off
    assert engine.get_stats().spec_num_accepted_tokens > 0
    ahead = "async_scheduling" in engine_kwargs
    assert (counts["drafts_behind"] > 0) == ahead
    assert (counts["behind_verification"] > 0) == ahead
    if "num_kv_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_real_prefix_cache_serves_blocks_of_accepted_tokens(smollm2_model, real_prompts,
                                                            real_off):
    """A speculating request publishes the full blocks of its accepted tokens; a later prompt
    that extends it by 16 of those tokens reads them from the cache and continues exactly as
    the first request did."""
    engine = make_engine(smollm2_model, NGRAM, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert generate(engine, real_prompts[:1], params) == real_off[:1]
    hits_before = engine.get_stats().prefix_cache_hits
    extended = real_prompts[0] + real_off[0][:16]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert generate(engine, [extended], params) == [real_off[0][16:24]]
    # Every full block of the extended prompt was cached, output blocks included.
    assert engine.get_stats().prefix_cache_hits - hits_before == (len(extended) - 1) // 4 * 4


@pytest.mark.slow
def test_real_seeded_sampling_identical(smollm2_model, real_prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=20,
                            ignore_eos=True)
    off = generate(make_engine(smollm2_model), real_prompts[:1], params)
    assert generate(make_engine(smollm2_model, NGRAM), real_prompts[:1], params) == off
