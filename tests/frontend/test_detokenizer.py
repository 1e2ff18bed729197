"""IncrementalDetokenizer with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyvllm.frontend.detokenizer import IncrementalDetokenizer
from tinyvllm.sampling_params import SamplingParams

MIXED_TEXT = (
    "Hello 世界! Ünïcödé façade, 日本語のテキスト 🎉🚀👩‍💻 done.\n"
    "def square(x: int) -> int:\n    return x ** 2  # 平方\n"
)
IM_END = "<|im_end|>"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def stream(detok: IncrementalDetokenizer, token_ids: list[int],
           chunk_sizes: list[int] | None = None) -> tuple[list[str], str | None]:
    """Feed token_ids in chunks (default one by one); return the deltas and the stop string."""
    deltas: list[str] = []
    chunk_sizes = chunk_sizes or [1] * len(token_ids)
    start = 0
    stop = None
    for size in chunk_sizes:
        stop = detok.update(token_ids[start:start + size])
        start += size
        deltas.append(detok.get_next_delta(finished=stop is not None))
        if stop is not None:
            return deltas, stop
    if start < len(token_ids):
        stop = detok.update(token_ids[start:])
    deltas.append(detok.get_next_delta(finished=True))
    return deltas, stop


def test_multibyte_characters_come_out_whole(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, MIXED_TEXT)
    detok = IncrementalDetokenizer(smollm2_tokenizer, SamplingParams())
    deltas, stop = stream(detok, ids)
    assert stop is None
    assert "".join(deltas) == smollm2_tokenizer.decode(ids) == MIXED_TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len([d for d in deltas if d])  # some characters did span several tokens


def test_prompt_context_does_not_leak_into_the_output(smollm2_tokenizer):
    prompt = encode(smollm2_tokenizer, "Translate: 世界")
    ids = encode(smollm2_tokenizer, " means world 🌍")
    detok = IncrementalDetokenizer(smollm2_tokenizer, SamplingParams(), prompt)
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == detok.output_text == " means world 🌍"


def stop_case(tokenizer, text: str, stop: str) -> list[int]:
    """Token ids of text, asserting that the stop string spans a token boundary."""
    ids = encode(tokenizer, text)
    pieces = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    start = text.index(stop)
    assert any(start < len(p) < start + len(stop) for p in pieces), "stop is inside one token"
    return ids


def test_stop_string_across_tokens_is_detected_and_never_streamed(smollm2_tokenizer):
    text = "The answer is 42. STOP_HERE and then more text follows."
    ids = stop_case(smollm2_tokenizer, text, "STOP_HERE")
    detok = IncrementalDetokenizer(smollm2_tokenizer, SamplingParams(stop=["zzz", "STOP_HERE"]))
    deltas, stop = stream(detok, ids)
    assert stop == "STOP_HERE"
    assert "".join(deltas) == detok.output_text == "The answer is 42. "
    streamed = ""
    for d in deltas:  # no prefix of the stop string was ever visible beyond the final text
        streamed += d
        assert "STOP" not in streamed
    # Tokens after the one that completed the stop string are dropped.
    assert smollm2_tokenizer.decode(detok.token_ids).endswith("HERE")


def test_include_stop_str_in_output(smollm2_tokenizer):
    text = "alpha beta<END>gamma"
    ids = stop_case(smollm2_tokenizer, text, "<END>")
    params = SamplingParams(stop=["<END>"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(smollm2_tokenizer, params)
    deltas, stop = stream(detok, ids)
    assert stop == "<END>"
    assert "".join(deltas) == detok.output_text == "alpha beta<END>"


def test_hold_back_releases_everything_on_finish(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "no stop in this text")
    detok = IncrementalDetokenizer(smollm2_tokenizer, SamplingParams(stop=["longstop"]))
    detok.update(ids)
    held = detok.get_next_delta(finished=False)
    assert held == detok.released_text == "no stop in this text"[:-(len("longstop") - 1)]
    assert detok.get_next_delta(finished=True) == "in this text"[-(len("longstop") - 1):]
    assert detok.output_text == detok.released_text == "no stop in this text"


def test_earliest_stop_string_wins(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "one two three four")
    detok = IncrementalDetokenizer(smollm2_tokenizer, SamplingParams(stop=["four", "two"]))
    assert detok.update(ids) == "two"
    assert detok.output_text == "one "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(smollm2_tokenizer, skip):
    ids = encode(smollm2_tokenizer, "Hi") + [smollm2_tokenizer.token_to_id(IM_END)] + \
        encode(smollm2_tokenizer, " there")
    detok = IncrementalDetokenizer(smollm2_tokenizer, SamplingParams(skip_special_tokens=skip))
    deltas, _ = stream(detok, ids)
    expected = "Hi there" if skip else f"Hi{IM_END} there"
    assert "".join(deltas) == detok.output_text == expected
    assert expected == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)


def test_stop_terminated_leaves_out_the_stop_token_text(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "Hi there\n\n")
    params = SamplingParams(skip_special_tokens=False, stop_token_ids=[ids[-1]])
    detok = IncrementalDetokenizer(smollm2_tokenizer, params)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == smollm2_tokenizer.decode(ids[:-1])
    assert detok.token_ids == ids


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), use_stop=st.booleans())
def test_any_split_into_update_chunks_gives_the_same_text(smollm2_tokenizer, data, use_stop):
    ids = encode(smollm2_tokenizer, MIXED_TEXT)
    params = SamplingParams(stop=["平方", "façade, 日"] if use_stop else None)
    reference = IncrementalDetokenizer(smollm2_tokenizer, params)
    ref_deltas, ref_stop = stream(reference, ids)

    sizes = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=len(ids)))
    detok = IncrementalDetokenizer(smollm2_tokenizer, params)
    deltas, stop = stream(detok, ids, sizes)
    assert "".join(deltas) == detok.output_text == "".join(ref_deltas) == reference.output_text
    assert stop == ref_stop
    assert detok.token_ids == reference.token_ids
    if use_stop:
        assert stop == "façade, 日" and detok.output_text == "Hello 世界! Ünïcödé "
