"""The real SmolLM2 GGUF through our loader vs transformers' GGUF loader: logits and tokenizer."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n",
           "1 2 3 4 5 6 7 8 9 10 11 12 13"]
TRICKY = ["x = [\n    1,", "for i in range(10):\n\tprint(i**2)  # 2024-01-31",
          "東京は日本の首都です。", "emoji 🤗🚀 and ümlaut", "  leading spaces and trailing  ",
          "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2=?"}]


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


def _smollm2_pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=True)])


def test_arch(smollm2_model):
    arch = smollm2_model.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.vocab_size == 49152 and arch.tie_word_embeddings and arch.head_dim == 64
    assert smollm2_model.max_model_len == 8192
    assert smollm2_model.model.lm_head is None


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_logits_match(prompt, smollm2_model, hf_model, paged_run):
    ids = smollm2_model.tokenizer.encode(prompt)
    logits = paged_run(smollm2_model.model, len(ids)).step([(ids, 0)])
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    assert (logits - expected).abs().max() < 1e-3
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_tokenizer_matches_corrected_transformers(smollm2_model, hf_tokenizer):
    ours = smollm2_model.tokenizer
    backend = hf_tokenizer.backend_tokenizer
    uncorrected = [backend.encode(text, add_special_tokens=False).ids for text in TRICKY]
    backend.pre_tokenizer = _smollm2_pre_tokenizer()
    for text in TRICKY:
        expected = hf_tokenizer.encode(text, add_special_tokens=False)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == text
    # transformers' GGUF conversion drops SmolLM2's digit splitting: the code string differs.
    assert uncorrected[0] != ours.encode(TRICKY[0])
    assert ours.encode(TRICKY[0]) == [104, 446, 933, 2367, 33, 28]


def test_chat_template_matches_transformers(smollm2_model, hf_tokenizer):
    ours = smollm2_model.tokenizer
    for messages in (MESSAGES, MESSAGES[1:2]):
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            rendered = ours.apply_chat_template(messages,
                                                add_generation_prompt=add_generation_prompt)
            assert rendered == expected
            assert ours.encode(rendered) == hf_tokenizer.encode(expected, add_special_tokens=False)


def test_special_tokens(smollm2_model):
    tok = smollm2_model.tokenizer
    assert tok.eos_token_ids == (2,)  # <|im_end|> is SmolLM2-Instruct's EOS
    assert tok.bos_token_id == 1 and tok.vocab_size == 49152
    assert tok.all_special_ids == list(range(17))
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # no BOS wanted
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    assert tok.name == "SmolLM2-135M-Instruct.Q4_1"
