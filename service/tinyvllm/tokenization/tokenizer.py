"""The model's tokenizer and chat template, loadable without the weights (the frontend uses it)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from tinyvllm.model_files import (SYNTHETIC_MODEL_VOCAB_SIZES, is_gguf, model_name, read_gguf,
                                  resolve_model_path)


RELEASE_GIL_MIN_CHARS = 4096
"""From this size on, text is encoded (and ids decoded) through the `*_batch` calls of
`tokenizers`, which release the GIL while they work; the single-item calls hold it throughout,
which would stall a server's event loop even when they run on a worker thread."""


class Tokenizer:
    """A `tokenizers.Tokenizer` (`backend`) with the model's special tokens and chat template."""

    def __init__(self, backend: BackendTokenizer, *, name: str, vocab_size: int,
                 bos_token_id: Optional[int], eos_token_ids: Sequence[int],
                 chat_template: Optional[str], add_bos_token: bool = False) -> None:
        if not eos_token_ids:
            raise ValueError(f"tokenizer of {name!r} has no EOS token")
        self.backend = backend
        self.name = name
        self.vocab_size = vocab_size
        """Rows of the model's embedding (may exceed the tokenizer's own vocabulary)."""
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        """The primary EOS first, then other end-of-turn ids (e.g. <|im_end|>, <|eot_id|>)."""
        self.chat_template = chat_template
        self._add_bos = add_bos_token and bos_token_id is not None

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def bos_token(self) -> Optional[str]:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self.backend.id_to_token(self.eos_token_id)

    @property
    def all_special_ids(self) -> list[int]:
        added = self.backend.get_added_tokens_decoder()
        return sorted(i for i, token in added.items() if token.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS only if the model wants one.

        A rendered chat template usually contains its own BOS: encode it with
        `add_special_tokens=False`.
        """
        if len(text) >= RELEASE_GIL_MIN_CHARS:
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) >= RELEASE_GIL_MIN_CHARS:
            return self.backend.decode_batch([list(ids)],
                                             skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """The decoded text each token adds, special tokens included: their concatenation is
        `decode(ids, skip_special_tokens=False)`. A character split over byte tokens comes out
        whole at its last byte; the tokens before it get ""."""
        stream = DecodeStream(skip_special_tokens=False)
        return [stream.step(self.backend, i) or "" for i in ids]

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each token ("Ġworld", "▁world", "<0xE6>")."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, **kwargs: Any) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers does.

        Raises:
            ValueError: the model has no chat template, a message is malformed, or the template
                rejects the conversation (`raise_exception`).
        """
        if not self.chat_template:
            raise ValueError(f"model {self.name!r} has no chat template; send a plain prompt")
        _validate_messages(messages)
        template = _compile_template(self.chat_template)
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools, bos_token=self.bos_token or "",
                                   eos_token=self.eos_token, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            # The template's own checks (`raise_exception`) reject the conversation: bad input.
            raise ValueError(f"chat template of {self.name!r} rejected the messages: {e}") from e


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string")
        content = message.get("content")
        # An assistant turn that only calls tools may carry no content.
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"messages[{i}].content must be a string")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators=None, sort_keys: bool = False) -> str:
    # Same signature and defaults as transformers' filter (ensure_ascii=False, unlike jinja's).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    if source not in _TEMPLATE_CACHE:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _TEMPLATE_CACHE[source] = env.from_string(source)
    return _TEMPLATE_CACHE[source]


# --- loading -----------------------------------------------------------------------------------

def load_tokenizer(model: Optional[str]) -> Tokenizer:
    """Load only the tokenizer of `model` (a .gguf file, a HF directory, None: the default, or a
    synthetic model name such as `llama3-8b-shape`: the byte-level tokenizer its engine uses)."""
    if model in SYNTHETIC_MODEL_VOCAB_SIZES:
        from tinyvllm.tokenization.synthetic import synthetic_tokenizer
        return synthetic_tokenizer(SYNTHETIC_MODEL_VOCAB_SIZES[model], model)
    path = resolve_model_path(model)
    if is_gguf(path):
        _, meta = read_gguf(path)
        return tokenizer_from_gguf_metadata(meta, vocab_size=None, name=model_name(path))
    return tokenizer_from_hf_dir(path)


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any], vocab_size: Optional[int],
                                 name: str) -> Tokenizer:
    from tinyvllm.tokenization.gguf_tokenizer import tokenizer_from_gguf

    backend = tokenizer_from_gguf(meta)
    arch = meta.get("general.architecture", "llama")
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return Tokenizer(
        backend, name=name,
        vocab_size=vocab_size or meta.get(f"{arch}.vocab_size")
        or len(meta["tokenizer.ggml.tokens"]),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(i) for i in eos_ids if i is not None],
        chat_template=meta.get("tokenizer.chat_template"),
        # SentencePiece (Llama 2, Mistral) models start with <s> unless the file says otherwise.
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token",
                                    meta.get("tokenizer.ggml.model") == "llama")))


def tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    """From tokenizer.json, tokenizer_config.json, config.json and generation_config.json."""
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path.name}: no tokenizer.json (slow tokenizers are not "
                                "supported)")
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    # tokenizer.json keeps the truncation and padding its maker last used (llm-compressor and
    # auto-round save the tokenizer they calibrated with, truncating at the calibration
    # length); transformers resets both on every call, and so must we.
    backend.no_truncation()
    backend.no_padding()
    tok_config = _read_json(path / "tokenizer_config.json")
    config = _read_json(path / "config.json")
    gen_config = _read_json(path / "generation_config.json")
    bos = _token_id(backend, tok_config.get("bos_token"))
    if bos is None:
        bos = config.get("bos_token_id")
    eos_ids = [_token_id(backend, tok_config.get("eos_token"))]
    for source in (gen_config, config):
        found = source.get("eos_token_id")
        eos_ids += found if isinstance(found, list) else [found]
    return Tokenizer(
        backend, name=model_name(path),
        vocab_size=config.get("vocab_size") or backend.get_vocab_size(),
        bos_token_id=bos, eos_token_ids=[i for i in eos_ids if i is not None],
        chat_template=_hf_chat_template(path, tok_config),
        add_bos_token=bool(tok_config.get("add_bos_token", False)))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(backend: BackendTokenizer, token: Any) -> Optional[int]:
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _hf_chat_template(path: Path, tok_config: Mapping[str, Any]) -> Optional[str]:
    """tokenizer_config's chat_template (a string, or a list with a `default` entry), or the
    separate chat_template.jinja file that newer transformers write."""
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return template
