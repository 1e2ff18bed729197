"""The byte-level tokenizer of models with random weights (`--model llama3-8b-shape`, tests)."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer as BackendTokenizer, decoders, models
from tokenizers import pre_tokenizers

from tinyvllm.tokenization.tokenizer import Tokenizer

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


def synthetic_tokenizer(vocab_size: int, name: str) -> Tokenizer:
    """A byte-level tokenizer whose vocabulary fills the model's `vocab_size` rows.

    Ids 0-255 are the bytes (GPT-2 byte-to-character map, no merges: text encodes byte by byte),
    ids 256 .. vocab_size - 3 decode as `<id>` (random weights emit them), then BOS and EOS.
    The model's weights are random, so its text means nothing; token-id prompts and timing are
    what it is for.
    """
    vocab = {ch: i for i, ch in enumerate(_byte_characters())}
    vocab.update({f"<{i}>": i for i in range(256, vocab_size - 2)})
    vocab[BOS_TOKEN], vocab[EOS_TOKEN] = vocab_size - 2, vocab_size - 1
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(BOS_TOKEN, special=True),
                                AddedToken(EOS_TOKEN, special=True)])
    return Tokenizer(backend, name=name, vocab_size=vocab_size, bos_token_id=vocab_size - 2,
                     eos_token_ids=[vocab_size - 1], chat_template=None, add_bos_token=True)


def _byte_characters() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0-255, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
