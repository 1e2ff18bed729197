"""LlamaArch from config.json dicts (classic keys and transformers 5 `rope_parameters`)."""

from __future__ import annotations

import pytest

from tinyvllm.model.arch import LlamaArch

BASE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}


def test_llama_classic_rope_keys():
    arch = LlamaArch.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"],
                                     "rope_theta": 500000.0, "rope_scaling": {
                                         "rope_type": "llama3", "factor": 8.0}})
    assert arch.head_dim == 32 and arch.num_kv_heads == 2 and arch.rope_theta == 500000.0
    assert arch.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert not arch.attention_bias and not arch.tie_word_embeddings


def test_rope_parameters_and_qwen2_bias():
    arch = LlamaArch.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"],
                                     "rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 1e6}, "head_dim": 64})
    assert arch.rope_theta == 1e6 and arch.rope_scaling is None
    assert arch.attention_bias and arch.head_dim == 64


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LlamaArch.from_hf_config({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="'gemma'"):
        LlamaArch.from_gguf_metadata({"general.architecture": "gemma"}, set(), 10)


def test_sliding_window_caps_context():
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    assert LlamaArch.from_hf_config({**mistral, "sliding_window": 4096}).max_position_embeddings \
        == 4096
    assert LlamaArch.from_hf_config({**mistral, "sliding_window": None}).max_position_embeddings \
        == 32768
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768,
            "sliding_window": 4096, "use_sliding_window": False}
    assert LlamaArch.from_hf_config(qwen).max_position_embeddings == 32768
