"""Build a `tokenizers.Tokenizer` from GGUF tokenizer metadata (`tokenizer.ggml.*`).

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported; the pre-tokenizer follows
`tokenizer.ggml.pre` the way llama.cpp does (src/llama-vocab.cpp), because the GGUF file stores the
vocabulary and merges but not the splitting rules.
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors

# llama.cpp token types (gguf.TokenType).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp groups these with StarCoder: every digit on its own, then the GPT-2 regex.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva")


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """Args: meta: GGUF metadata key -> python value (tokens, merges and token_type as lists).

    Raises:
        NotImplementedError: a tokenizer model other than `gpt2` (e.g. SentencePiece `llama`).
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
            "use the model's Hugging Face directory with tokenizer.json instead")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = meta.get("tokenizer.ggml.pre", "default")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=pre == "llama-bpe"))
    _set_pre_tokenizer(tok, pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(_added_tokens(tokens, meta.get("tokenizer.ggml.token_type"), special=False))
    tok.add_special_tokens(_added_tokens(tokens, meta.get("tokenizer.ggml.token_type"),
                                         special=True))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tok


def _set_pre_tokenizer(tok: Tokenizer, pre: str) -> None:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "qwen2"):
        pattern = _LLAMA3_PATTERN if pre == "llama-bpe" else _QWEN2_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        if pre == "qwen2":
            tok.normalizer = normalizers.NFC()
    else:
        tok.pre_tokenizer = byte_level  # GPT-2 default


def _added_tokens(tokens: list[str], token_types, special: bool) -> list[AddedToken]:
    if token_types is None:
        return []
    wanted = _TOKEN_TYPE_CONTROL if special else _TOKEN_TYPE_USER_DEFINED
    return [AddedToken(tokens[i], special=special, normalized=False)
            for i, t in enumerate(token_types) if t == wanted]
