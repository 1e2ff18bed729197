"""Tiny random Llama / Mistral / Qwen2 checkpoints saved by transformers, loaded by us."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tinyvllm.model import load_model
from tinyvllm.tokenization import load_tokenizer

VOCAB_SIZE = 384
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXT = "Hello world! The quick brown fox jumps over 13 lazy dogs.\n    x = [1, 2]"
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def _tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE trained in milliseconds, with <s> (1) and </s> (2) special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<eot>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, "hello there, general kenobi"] * 10, trainer)
    return tok


def _common(**extra):
    return dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **extra)


def _make_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_common(tie_word_embeddings=False,
                                                  rope_parameters=LLAMA3_ROPE)))


def _make_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_common(sliding_window=None, head_dim=16,
                                                      tie_word_embeddings=False)))


def _make_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_common(tie_word_embeddings=True)))


def _save(hf_model, directory, max_shard_size="50GB"):
    torch.manual_seed(0)
    with torch.no_grad():  # transformers' init leaves norms at 1 and biases at 0: perturb them
        for name, p in hf_model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf_model.save_pretrained(directory, max_shard_size=max_shard_size)
    _tiny_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
         "chat_template": CHAT_TEMPLATE}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))


@pytest.mark.parametrize("make,max_shard_size", [(_make_llama, "50KB"), (_make_mistral, "50GB"),
                                                 (_make_qwen2, "50GB")],
                         ids=["llama3-sharded", "mistral", "qwen2-bias-tied"])
def test_logits_match_transformers(make, max_shard_size, tmp_path, paged_run):
    torch.manual_seed(0)
    hf_model = make().eval()
    _save(hf_model, tmp_path, max_shard_size)
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    ids = loaded.tokenizer.encode(TEXT)
    assert ids[0] == 1 and len(ids) > 20  # add_bos_token honoured
    logits = paged_run(loaded.model, len(ids)).step([(ids, 0)])
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    arch = loaded.arch
    assert arch.attention_bias == (make is _make_qwen2)
    assert arch.tie_word_embeddings == (make is _make_qwen2)
    if make is _make_llama:
        assert arch.rope_scaling["rope_type"] == "llama3"
        assert len(list(tmp_path.glob("*.safetensors"))) > 1


def test_tokenizer_from_hf_dir(tmp_path):
    torch.manual_seed(0)
    _save(_make_qwen2(), tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_ids == (2, 3) and tok.bos_token_id == 1
    assert tok.vocab_size == VOCAB_SIZE and tok.name == tmp_path.name
    assert tok.decode(tok.encode(TEXT)) == TEXT
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<s><|user|>hi</s><|assistant|>"


def test_truncation_saved_in_tokenizer_json_is_ignored(tmp_path):
    """A tokenizer saved while truncating (as the quantization tools leave theirs) encodes whole
    texts, as transformers does."""
    torch.manual_seed(0)
    _save(_make_llama(), tmp_path)
    saved = _tiny_tokenizer()
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=64)
    saved.save(str(tmp_path / "tokenizer.json"))
    ids = load_tokenizer(str(tmp_path)).encode(TEXT, add_special_tokens=False)
    assert ids == _tiny_tokenizer().encode(TEXT).ids and len(ids) > 4


def test_no_safetensors_is_refused(tmp_path):
    torch.manual_seed(0)
    _save(_make_mistral(), tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("quant", [
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {"quant_method": "fp8", "activation_scheme": "dynamic"},
    {"quant_method": "hqq", "nbits": 4},
], ids=lambda q: q["quant_method"])
def test_unsupported_quantized_checkpoint_is_refused_by_name(quant, tmp_path):
    """Formats we read (GPTQ, AWQ, ...) are tested in test_quantized.py."""
    torch.manual_seed(0)
    _save(_make_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=f"'{quant['quant_method']}' quantized checkpoints"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_quantized_tensors_of_a_float_projection_are_named(tmp_path):
    """A GPTQ config over float weights: the quantized projections' tensors are missing."""
    torch.manual_seed(0)
    _save(_make_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=r"\w+_proj\.weight: unexpected tensor for gptq"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_unknown_tensor_is_named_not_a_bare_key_error(tmp_path):
    """A packed GPTQ tensor in a checkpoint without quantization_config."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    _save(_make_mistral(), tmp_path)
    save_file({"model.layers.0.self_attn.q_proj.qweight": torch.zeros(8, 64, dtype=torch.int32)},
              str(tmp_path / "zz-extra.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj\.qweight.*not supported"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_config_missing_a_key_is_named(tmp_path):
    torch.manual_seed(0)
    _save(_make_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))
