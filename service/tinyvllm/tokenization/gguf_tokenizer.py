"""Build a `tokenizers.Tokenizer` from GGUF tokenizer metadata (`tokenizer.ggml.*`).

Two tokenizer models are supported:
* byte-level BPE (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen2, SmolLM2): the pre-tokenizer
  follows `tokenizer.ggml.pre` the way llama.cpp does (src/llama-vocab.cpp), because the GGUF file
  stores the vocabulary and merges but not the splitting rules;
* SentencePiece BPE (`"llama"`: Llama 2, Mistral), stored as pieces, scores and token types: a
  BPE with byte fallback whose merges are rebuilt from the scores, as transformers' GGUF
  converter does (a piece made of two pieces is a merge ranked by the piece's score).
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors

# llama.cpp token types (gguf.TokenType).
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_SPACE_PIECE = "\u2581"  # SentencePiece's visible space, "▁"

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
        NotImplementedError: a tokenizer model other than `gpt2` and `llama` (e.g. `bert`, `rwkv`).
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_tokenizer(meta)
    if kind != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2' and "
            "SentencePiece 'llama'); use the model's Hugging Face directory with tokenizer.json "
            "instead")
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
    _add_bos(tok, tokens, meta, default=False)
    return tok


def _add_bos(tok: Tokenizer, tokens: list[str], meta: Mapping[str, Any], default: bool) -> None:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", default) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


def _sentencepiece_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral) from pieces, scores and token types."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    token_types = meta.get("tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, scores, vocab),
                               unk_token=None if unk_id is None else tokens[unk_id],
                               fuse_unk=True, byte_fallback=True))
    # llama.cpp's default (add_space_prefix) is SentencePiece's add_dummy_prefix: "▁" first.
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(_SPACE_PIECE)] if space_prefix else [])
        + [normalizers.Replace(" ", _SPACE_PIECE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    special = [_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN]
    tok.add_tokens(_added_tokens(tokens, token_types, special=False))
    if token_types is not None:
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(token_types) if t in special])
    _add_bos(tok, tokens, meta, default=True)  # SentencePiece models start with <s>
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]
                        ) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge; SentencePiece merges
    the pair whose result scores highest first, so merges are ranked by the merged piece's score
    (ties: lower ids first)."""
    merges = []
    for piece_id, piece in enumerate(tokens):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[piece_id], vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


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
