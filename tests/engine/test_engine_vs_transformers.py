"""Greedy output of the engine equals Hugging Face transformers' on the same GGUF weights.

Transformers dequantizes the same Q4_1 GGUF to float32 with its own loader; both run in float32
on the CPU. The same prompts must then give the same tokens whatever the engine does with them:
alone or batched, chunked prefill, prefix caching on or off, and under preemption.
"""

from __future__ import annotations

import pytest
import torch

from tinyvllm.sampling_params import SamplingParams

from .conftest import assert_all_blocks_free, make_engine, run_to_completion

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
_LONG = " ".join(
    f"Section {i}: the river carried {i * 7} boats past the old mill, and the miller counted "
    f"them twice before writing the number in his ledger." for i in range(20))
TEXT_PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n",
    "x = [\n    1,\n    22,\n    333,",
    "日本の首都は東京です。🌸 The weather in Tokyo today is",
    "Once upon a time, in a small village by the sea,",
    "Fibonacci: 1, 1, 2, 3, 5, 8, 13, 21,",
    _LONG + "\nSummary of the ledger:",
]
CHAT = [{"role": "user", "content": "What is the boiling point of water in Celsius?"}]


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tok = smollm2.tokenizer
    ids = [tok.encode(p) for p in TEXT_PROMPTS]
    ids.append(tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False))
    assert len(ids[6]) > 500, "the long prompt must exceed 500 tokens"
    return ids


@pytest.fixture(scope="module")
def hf_greedy(smollm2, prompts) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    path = smollm2.path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    eos = list(smollm2.tokenizer.eos_token_ids)
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
            results.append(_cut_at_eos(out[0, len(ids):].tolist(), eos))
    return results


def _cut_at_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)


def test_each_prompt_alone_matches_transformers(smollm2, prompts, hf_greedy):
    engine = make_engine(smollm2)
    ours = [run_to_completion(engine, [p], GREEDY)[0] for p in prompts]
    for i, (a, b) in enumerate(zip(ours, hf_greedy)):
        assert a == b, f"prompt {i} differs"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("engine_kwargs", [
    pytest.param({}, id="batched"),
    pytest.param({"max_num_batched_tokens": 32}, id="chunked-prefill-32"),
    pytest.param({"enable_prefix_caching": False}, id="no-prefix-caching"),
    pytest.param({"num_kv_blocks": 48}, id="preemption"),
])
def test_batched_variants_match_transformers(smollm2, prompts, hf_greedy, engine_kwargs):
    engine = make_engine(smollm2, **engine_kwargs)
    # The long prompt first: it fills most of a small cache, so the others must be preempted
    # when it grows.
    order = [6, 0, 1, 2, 3, 4, 5, 7]
    ours = run_to_completion(engine, [prompts[i] for i in order], GREEDY)
    assert ours == [hf_greedy[i] for i in order]
    if "num_kv_blocks" in engine_kwargs:
        assert engine.get_stats().num_preemptions > 0, "the cache was meant to be too small"
    assert_all_blocks_free(engine)


def test_shared_prefix_is_served_from_cache(smollm2, prompts, hf_greedy):
    engine = make_engine(smollm2)
    long_prompt = prompts[6]
    run_to_completion(engine, [long_prompt], GREEDY)
    # A second request with the same long prefix and a different ending.
    other = long_prompt[:-3] + smollm2.tokenizer.encode(" In short,", add_special_tokens=False)
    engine.add_request(_request("again", other))
    cached, computed = None, 0
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        computed += out.num_scheduled_tokens
        sampled = engine.runner.execute(out)
        for o in engine.scheduler.update(out, sampled):
            cached = o.num_cached_tokens
    block = engine.runtime_info.block_size
    assert cached == (len(long_prompt) - 3) // block * block
    # Only the uncached tail of the prompt and the decode steps were computed.
    assert computed == len(other) - cached + (GREEDY.max_tokens - 1)
    assert_all_blocks_free(engine)


def test_aborted_requests_free_their_blocks(smollm2, prompts):
    engine = make_engine(smollm2)
    for i, p in enumerate(prompts):
        engine.add_request(_request(str(i), p))
    engine.step()
    engine.step()
    engine.abort_requests([str(i) for i in range(len(prompts))])
    assert_all_blocks_free(engine)


def _request(request_id, ids):
    from tinyvllm.scheduling.request import EngineCoreRequest
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=GREEDY)


def test_context_length_is_capped_to_what_the_cache_holds(smollm2):
    engine = make_engine(smollm2, num_kv_blocks=9)  # 8 usable blocks of 16 tokens
    assert engine.runtime_info.max_model_len == 128
    from tinyvllm.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="^prompt: is 128 tokens"):
        engine.add_request(_request("too-long", list(range(100, 228))))
    out = run_to_completion(engine, [list(range(100, 220))],
                            SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out[0]) == 8  # up to the capped context length, then "length"
    assert_all_blocks_free(engine)
