"""Draft-model speculation (`method: draft_model`): the scheduler's lookahead slots and their
rollback (exact block counts), the config's errors, and the engine's output with a
layer-truncated self-draft and with a separate draft checkpoint (in process and on two
tensor-parallel ranks), which must equal plain decoding token for token with no block leaked."""

from __future__ import annotations

import argparse

import pytest

from tinyvllm.config import (EngineConfig, SchedulerConfig, SpeculativeConfig,
                             add_engine_arguments)
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.scheduling.kv_cache_manager import KVCacheManager
from tinyvllm.scheduling.request import EngineCoreRequest, Request
from tinyvllm.scheduling.scheduler import Scheduler
from tinyvllm.sampling_params import SamplingParams

from .conftest import assert_all_blocks_free
from .test_spec_decode import (PARAMS, TINY_PROMPTS, generate, make_engine,  # noqa: F401
                               real_off, real_prompts)  # fixtures

BLOCK = 4


def draft_spec(num_layers: int, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": k, "draft_num_layers": num_layers,
            **extra}


# --- scheduling: lookahead slots for the worker's drafts ------------------------------------

def make_scheduler(num_blocks=16, k=4):
    kv = KVCacheManager(num_blocks, BLOCK, True, hash_seed=1)
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=k,
                               draft_num_layers=1, adaptive=False)
    return Scheduler(SchedulerConfig(), kv, max_model_len=1000, speculative=config)


def make_request(rid, prompt, max_tokens=20):
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
                   eos_token_ids=frozenset({0}))


def test_lookahead_slots_hold_the_drafts_then_roll_back():
    s = make_scheduler()
    r = make_request("a", [1, 2, 3, 4, 5, 6])
    s.add_request(r)
    out = s.schedule()
    (step,) = out.scheduled
    # The prefill (positions 0..5) samples; the worker then drafts 4 tokens at positions 6..9.
    assert step.num_new_tokens == 6 and step.num_lookahead_tokens == 4
    assert len(s.kv.block_ids("a")) == 3  # 10 positions
    s.update(out, {"a": (7, None)}, draft_token_ids={"a": [8, 9, 10, 11]})
    assert r.draft_token_ids == [8, 9, 10, 11]
    assert len(s.kv.block_ids("a")) == 2  # the lookahead block went back: 6 computed tokens
    out = s.schedule()
    (step,) = out.scheduled
    # Verified like an n-gram draft: 7 and the drafts at positions 6..10, lookahead 11..14.
    assert step.draft_token_ids == [8, 9, 10, 11] and step.num_new_tokens == 5
    assert step.num_lookahead_tokens == 4 and len(s.kv.block_ids("a")) == 4
    assert r.draft_token_ids == []  # taken
    (result,) = s.update(out, {"a": ([8, 9, 12], None)}, draft_token_ids={"a": [13, 14]})
    assert result.new_token_ids == [8, 9, 12]
    assert r.num_computed_tokens == 9 and len(s.kv.block_ids("a")) == 3  # positions 0..8
    assert r.draft_token_ids == [13, 14]
    assert s.kv.num_free_blocks == s.kv.num_blocks - 1 - 3
    assert s.spec.stats.num_draft_tokens == 4 and s.spec.stats.num_accepted_tokens == 2


def test_no_drafts_back_means_a_plain_decode():
    s = make_scheduler()
    r = make_request("a", [1, 2, 3])
    s.add_request(r)
    s.update(s.schedule(), {"a": (7, None)})  # the worker proposed nothing
    (step,) = s.schedule().scheduled
    assert step.num_new_tokens == 1 and step.draft_token_ids == []


def test_lookahead_never_costs_a_preemption():
    # 3 usable blocks: the 11-token prompt needs all of them, its lookahead one more.
    s = make_scheduler(num_blocks=4)
    s.add_request(make_request("a", range(1, 12)))
    (step,) = s.schedule().scheduled
    assert step.num_new_tokens == 11 and step.num_lookahead_tokens == 0
    assert s.num_preemptions == 0


def test_lookahead_is_capped_by_max_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    # After the prefill's token, the next step may yield 2 tokens: 1 draft at most.
    assert s.schedule().scheduled[0].num_lookahead_tokens == 1


# --- the config ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec, error", [
    (draft_spec(0), "draft_num_layers must be positive"),
    (draft_spec(1, k=0), "num_speculative_tokens must be positive"),
    ({"method": "draft"}, "method must be one of"),
    ({"method": "draft_model"}, "needs exactly one of 'model'"),
    ({"method": "draft_model", "model": "x", "draft_num_layers": 1}, "needs exactly one of"),
    ({"method": "ngram", "draft_num_layers": 1}, "draft_num_layers needs method 'draft_model'"),
])
def test_bad_draft_configs_name_the_key(spec, error):
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.parse(spec)


def test_draft_deeper_than_the_target_is_refused_at_start(tiny_model):
    with pytest.raises(ValueError, match=r"draft_num_layers must be in \[1, 2\].*got 3"):
        make_engine(tiny_model, draft_spec(3))


def test_cli_help_names_the_draft_keys():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "draft_model" in text and "draft_num_layers" in text
    config = EngineConfig.from_kwargs(speculative_config=draft_spec(2, k=3))
    assert config.speculative.uses_draft_model and config.speculative.draft_num_layers == 2


# --- the engine with the tiny random model (2 layers) --------------------------------------

ENGINES = {"batched": {}, "chunked": {"max_num_batched_tokens": 7},
           "preempting": {"num_kv_blocks": 10},
           "no_prefix_caching": {"enable_prefix_caching": False}}


def test_full_depth_draft_accepts_every_greedy_proposal(tiny_model):
    """A draft equal to the target: every greedy draft token is the target's own."""
    kwargs = {"block_size": 4, "num_kv_blocks": 64}
    off = generate(make_engine(tiny_model, **kwargs), TINY_PROMPTS, PARAMS["greedy"])
    engine = make_engine(tiny_model, draft_spec(2), **kwargs)
    assert generate(engine, TINY_PROMPTS, PARAMS["greedy"]) == off
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_num_accepted_per_position[0] == stats.spec_num_drafts


@pytest.mark.parametrize("engine_kwargs", ENGINES.values(), ids=ENGINES.keys())
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("params", ["greedy", "seeded", "penalties"])
def test_truncated_draft_same_tokens_as_plain_decoding(tiny_model, num_layers, params,
                                                       engine_kwargs):
    params = PARAMS[params]
    kwargs = {"block_size": 4, "num_kv_blocks": 64, **engine_kwargs}
    off = generate(make_engine(tiny_model, **kwargs), TINY_PROMPTS, params)
    engine = make_engine(tiny_model, draft_spec(num_layers), **kwargs)
    assert generate(engine, TINY_PROMPTS, params) == off
    drafted = engine.get_stats().spec_num_draft_tokens
    assert drafted == 0 if params.repetition_penalty != 1.0 else drafted > 0
    if engine_kwargs.get("num_kv_blocks"):
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_is_never_passed(tiny_model, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    off = generate(make_engine(tiny_model), TINY_PROMPTS, params)
    on = generate(make_engine(tiny_model, draft_spec(2)), TINY_PROMPTS, params)
    assert on == off and all(len(t) == max_tokens for t in on)


def test_verification_beside_a_prefill_and_prefix_cache_hits(tiny_model):
    """A request verifies drafts in the same steps as another's prefill chunks; then the same
    prompts again, served from the prefix cache (their outputs' full blocks included)."""
    params = PARAMS["greedy"]
    kwargs = {"block_size": 4, "max_num_batched_tokens": 6}
    off = generate(make_engine(tiny_model, **kwargs), TINY_PROMPTS[1:], params)
    engine = make_engine(tiny_model, draft_spec(1), **kwargs)
    steps = []
    execute = engine.executor.execute_async
    engine.executor.execute_async = lambda out: steps.append(out) or execute(out)
    tokens = {"0": [], "1": []}
    engine.add_request(EngineCoreRequest(request_id="0", prompt_token_ids=TINY_PROMPTS[1],
                                         sampling_params=params))
    while engine.has_unfinished_requests():
        if len(tokens["0"]) >= 2 and "1" not in engine.scheduler.requests and not tokens["1"]:
            engine.add_request(EngineCoreRequest(request_id="1", prompt_token_ids=TINY_PROMPTS[2],
                                                 sampling_params=params))
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    assert [tokens["0"], tokens["1"]] == off
    assert any(any(s.draft_token_ids for s in out.scheduled)
               and any(s.num_new_tokens > 1 and not s.draft_token_ids for s in out.scheduled)
               for out in steps)  # a verification and a prefill chunk in one step
    assert_all_blocks_free(engine)
    hits_before = engine.get_stats().prefix_cache_hits
    assert generate(engine, TINY_PROMPTS[1:], params) == off
    assert engine.get_stats().prefix_cache_hits > hits_before


# --- a separate draft checkpoint (its own KV cache over the target's block ids) -------------

def tiny_loaded(vocab_size: int = 512, num_layers: int = 2, seed: int = 3):
    import torch

    from tinyvllm.model.loader import LoadedModel
    from tinyvllm.model.synthetic import make_random_model, tiny_arch
    from tinyvllm.tokenization.synthetic import synthetic_tokenizer

    arch = tiny_arch(vocab_size=vocab_size, num_layers=num_layers)
    model = make_random_model(arch, seed=seed, dtype=torch.float32, device=torch.device("cpu"))
    return LoadedModel(model=model, arch=arch, tokenizer=synthetic_tokenizer(vocab_size, "tiny"),
                       name=f"tiny-{num_layers}-{seed}", path=None,
                       max_model_len=arch.max_position_embeddings)


def make_engine_with_draft(target, draft, k: int = 4, **kwargs) -> EngineCore:
    from tinyvllm.engine.executor import UniProcExecutor
    from tinyvllm.worker.model_runner import ModelRunner

    spec = {"method": "draft_model", "model": draft.name, "num_speculative_tokens": k}
    config = EngineConfig.from_kwargs(device="cpu", dtype="float32", speculative_config=spec,
                                      **kwargs)
    runner = ModelRunner(config, loaded=target, draft_loaded=draft)
    return EngineCore(config, UniProcExecutor(config, runner))


@pytest.fixture(scope="module")
def small_draft():
    """A different random model with the target's vocabulary: one layer, another seed."""
    return tiny_loaded(num_layers=1, seed=5)


def test_draft_checkpoint_equal_to_the_target_accepts_every_greedy_proposal(tiny_model):
    kwargs = {"block_size": 4, "num_kv_blocks": 64}
    off = generate(make_engine(tiny_model, **kwargs), TINY_PROMPTS, PARAMS["greedy"])
    engine = make_engine_with_draft(tiny_model, tiny_model, **kwargs)
    assert len(engine.runner.drafter.kv_caches) == 2  # its own cache tensors
    assert engine.runner.drafter.kv_caches[0] is not engine.runner.kv_caches[0]
    assert generate(engine, TINY_PROMPTS, PARAMS["greedy"]) == off
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


@pytest.mark.parametrize("engine_kwargs", ENGINES.values(), ids=ENGINES.keys())
@pytest.mark.parametrize("params", ["greedy", "seeded"])
def test_draft_checkpoint_same_tokens_as_plain_decoding(tiny_model, small_draft, params,
                                                        engine_kwargs):
    params = PARAMS[params]
    kwargs = {"block_size": 4, "num_kv_blocks": 64, **engine_kwargs}
    off = generate(make_engine(tiny_model, **kwargs), TINY_PROMPTS, params)
    engine = make_engine_with_draft(tiny_model, small_draft, **kwargs)
    assert generate(engine, TINY_PROMPTS, params) == off
    assert engine.get_stats().spec_num_draft_tokens > 0
    if engine_kwargs.get("num_kv_blocks"):
        assert engine.scheduler.num_preemptions > 0


def test_draft_checkpoint_halves_the_blocks_of_a_fixed_cache_budget(tiny_model):
    """Its cache is sized into the same memory: a draft as deep as the target, half the blocks."""
    plain = make_engine(tiny_model, kv_cache_memory_gb=0.001)
    engine = make_engine_with_draft(tiny_model, tiny_model, kv_cache_memory_gb=0.001)
    assert engine.runner.num_blocks == plain.runner.num_blocks // 2


def test_draft_checkpoint_with_another_vocabulary_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"speculative_config.model: .* vocabulary of 256 "
                                         r"tokens, the target tiny 512"):
        make_engine_with_draft(tiny_model, tiny_loaded(vocab_size=256))


@pytest.mark.slow
def test_draft_checkpoint_is_loaded_and_checked_at_start(tiny_model, smollm2_path):
    """The path goes through the loader like --model; SmolLM2's vocabulary is not the tiny's."""
    spec = {"method": "draft_model", "model": str(smollm2_path)}
    with pytest.raises(ValueError, match="speculative_config.model: .*vocabulary of 49152"):
        make_engine(tiny_model, spec)


# --- tensor parallelism: two worker processes (gloo) ----------------------------------------

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A 2-layer target and a 1-layer draft with its vocabulary, as safetensors directories."""
    import torch

    from tinyvllm.model.synthetic import random_weights, tiny_arch
    from tests.model.test_tensor_parallel import _write_hf_dir

    dirs = []
    for name, layers, seed in (("target", 2, 5), ("draft", 1, 6)):
        arch = tiny_arch(vocab_size=512, num_heads=4, num_kv_heads=2, num_layers=layers)
        weights = dict(random_weights(arch, seed, torch.float32, torch.device("cpu")))
        dirs.append(_write_hf_dir(tmp_path_factory.mktemp(name), arch, weights))
    return dirs


@pytest.mark.parametrize("draft", ["draft_num_layers", "model"])
def test_two_ranks_drafting_give_the_one_rank_tokens(hf_dirs, draft):
    """Every rank runs the draft steps (its layers take part in the collectives); rank 0's
    drafts come back with its tokens, beside a row that never speculates (logprobs)."""
    from tests.engine.conftest import run_to_completion

    target, draft_dir = hf_dirs
    prompts = [[7, 8, 9, 10] * 3, [5, 17, 99, 3, 250, 8]]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)]

    def config(size: int, **kwargs) -> EngineConfig:
        return EngineConfig.from_kwargs(model=target, device="cpu", dtype="float32",
                                        max_model_len=128, num_kv_blocks=40, block_size=16,
                                        max_num_batched_tokens=24, tensor_parallel_size=size,
                                        **kwargs)

    one = EngineCore(config(1))
    expected = run_to_completion(one, prompts, params)
    one.shutdown()
    spec = {"method": "draft_model",
            **({"draft_num_layers": 1} if draft == "draft_num_layers" else {"model": draft_dir})}
    engine = EngineCore(config(2, speculative_config=spec))
    try:
        assert run_to_completion(engine, prompts, params) == expected
        assert engine.get_stats().spec_num_drafts > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


# --- the bundled model ------------------------------------------------------------------------

REAL_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.slow
def test_real_full_depth_self_draft_accepts_everything(smollm2_model, real_prompts, real_off):
    engine = make_engine(smollm2_model, draft_spec(smollm2_model.arch.num_layers))
    assert generate(engine, real_prompts[1:2], REAL_GREEDY) == real_off[1:2]
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


@pytest.mark.slow
def test_real_truncated_self_draft_mixed_batch_greedy_identical(smollm2_model, real_prompts,
                                                                real_off):
    """Prompts chunked while others verify drafts, prefix caching on (the default)."""
    engine = make_engine(smollm2_model, draft_spec(8), max_num_batched_tokens=24)
    assert generate(engine, real_prompts, REAL_GREEDY) == real_off
    assert engine.get_stats().spec_num_accepted_tokens > 0
