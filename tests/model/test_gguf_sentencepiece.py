"""SentencePiece GGUF tokenizers (`tokenizer.ggml.model == "llama"`, Llama 2 / Mistral): a
SentencePiece BPE model trained here is written into a GGUF with the gguf writer, the way
llama.cpp's converter stores it (pieces, scores, token types), and our tokenizer built from the
file must encode and decode as SentencePiece itself does."""

from __future__ import annotations

import gguf
import pytest

from tinyvllm.tokenization import load_tokenizer

spm = pytest.importorskip("sentencepiece")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Tokenizers split text into pieces; pieces become ids.",
    "Llama 2 and Mistral use SentencePiece with byte fallback for rare characters.",
    "    indented code: x = [1, 2, 3]  # comment",
    "Numbers like 1234 and 56.78, and the year 2024.",
] * 20
TEXTS = [
    "Hello world",
    "The lazy fox, the quick dog.",
    "  two leading spaces and  double  spaces",
    "line one\nline two\ttab",
    "héllo wörld ✓ 日本語 🦙",  # characters outside the vocabulary: byte fallback
    "Mistral's tokenizer handles 1234567 digits.",
]


def _spm_type(sp, i: int) -> gguf.TokenType:
    if sp.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.is_control(i):
        return gguf.TokenType.CONTROL
    if sp.is_byte(i):
        return gguf.TokenType.BYTE
    if sp.is_unused(i):
        return gguf.TokenType.UNUSED
    return gguf.TokenType.NORMAL


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    """(SentencePieceProcessor, path of a GGUF holding its vocabulary)."""
    d = tmp_path_factory.mktemp("spm")
    (d / "corpus.txt").write_text("\n".join(CORPUS))
    # Llama 2's settings: BPE, byte fallback, no normalization, whitespace kept as is.
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), model_type="bpe",
        vocab_size=400, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, unk_id=0, bos_id=1, eos_id=2,
        character_coverage=1.0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(d / "sp.model"))
    n = sp.get_piece_size()
    path = d / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([_spm_type(sp, i) for i in range(n)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp, path


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_like_sentencepiece(sentencepiece, text):
    sp, path = sentencepiece
    tok = load_tokenizer(str(path))
    expected = sp.encode(text)
    assert tok.encode(text, add_special_tokens=False) == expected
    assert tok.encode(text) == [1] + expected  # <s> first, as Llama 2 / Mistral expect
    assert tok.decode(tok.encode(text)) == sp.decode(expected) == text


def test_special_tokens(sentencepiece):
    sp, path = sentencepiece
    tok = load_tokenizer(str(path))
    assert tok.bos_token == "<s>" and tok.eos_token_ids == (2,)
    ids = tok.encode("Hello</s>", add_special_tokens=False)
    assert ids[-1] == 2 and ids[:-1] == sp.encode("Hello")
    assert tok.decode(ids, skip_special_tokens=False) == "Hello</s>"
    assert tok.decode(ids) == "Hello"


def test_other_tokenizer_models_are_refused_by_name():
    from tinyvllm.tokenization.gguf_tokenizer import tokenizer_from_gguf

    with pytest.raises(NotImplementedError, match="'bert'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "bert"})
