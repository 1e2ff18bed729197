"""A tiny Llama written as GGUF the way llama.cpp's converter does, loaded back by us."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from tinyvllm.model import load_model
from tinyvllm.tokenization import load_tokenizer
from tinyvllm.model.synthetic import make_random_model, tiny_arch

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MERGES = ["h e", "l l", "he ll", "Ġ w"]
SPECIALS = ["<|endoftext|>", "<|im_end|>"]
TOKENS = pre_tokenizers.ByteLevel.alphabet()
TOKENS = sorted(TOKENS) + ["he", "ll", "hell", "Ġw"] + SPECIALS
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF half-split rows -> interleaved)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _hf_state(model) -> dict[str, np.ndarray]:
    """Our merged parameters split back into HF tensors."""
    a = model.arch
    out = {"token_embd.weight": model.model.embed_tokens.weight,
           "output_norm.weight": model.model.norm}
    for i, layer in enumerate(model.model.layers):
        q, k, v = layer.self_attn.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        out.update({
            f"blk.{i}.attn_norm.weight": layer.input_layernorm,
            f"blk.{i}.ffn_norm.weight": layer.post_attention_layernorm,
            f"blk.{i}.attn_q.weight": _llama_cpp_permute(q.numpy(), a.num_heads),
            f"blk.{i}.attn_k.weight": _llama_cpp_permute(k.numpy(), a.num_kv_heads),
            f"blk.{i}.attn_v.weight": v,
            f"blk.{i}.attn_output.weight": layer.self_attn.o_proj.weight,
            f"blk.{i}.ffn_gate.weight": gate, f"blk.{i}.ffn_up.weight": up,
            f"blk.{i}.ffn_down.weight": layer.mlp.down_proj.weight})
    return {n: np.ascontiguousarray(np.asarray(t, dtype=np.float32)) for n, t in out.items()}


def _rope_freqs(arch) -> np.ndarray:
    from tinyvllm.ops.layers import _scale_inv_freq

    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float64)
                                     / arch.head_dim))
    return (inv / _scale_inv_freq(inv, LLAMA3_SCALING)).float().numpy()


def _write_gguf(path, model, pre="smollm", qtype=None, raw=None):
    """The model as a GGUF file: matrices F16, or quantized to `qtype` (a GGMLQuantizationType);
    `raw` maps tensor names to (blocks [rows, row_bytes] uint8, GGMLQuantizationType) written in
    place of the model's matrix of that name."""
    a = model.arch
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-gguf")
    for key, value in {"block_count": a.num_layers, "context_length": a.max_position_embeddings,
                       "embedding_length": a.hidden_size, "feed_forward_length":
                       a.intermediate_size, "attention.head_count": a.num_heads,
                       "attention.head_count_kv": a.num_kv_heads,
                       "attention.key_length": a.head_dim,  # head_dim != hidden / heads here
                       "rope.dimension_count": a.head_dim}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", a.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", a.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_merges(MERGES)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL
                       for t in TOKENS])
    w.add_bos_token_id(TOKENS.index("<|endoftext|>"))
    w.add_eos_token_id(TOKENS.index("<|endoftext|>"))
    w.add_eot_token_id(TOKENS.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, tensor in _hf_state(model).items():
        if raw and name in raw:
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        elif tensor.ndim == 1:
            w.add_tensor(name, tensor)
        elif qtype is None:
            w.add_tensor(name, tensor.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(tensor.astype(np.float32), qtype),
                         raw_dtype=qtype)
    w.add_tensor("rope_freqs.weight", _rope_freqs(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    arch = tiny_arch(vocab_size=len(TOKENS), tie_word_embeddings=True, num_heads=6,
                     num_kv_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                     max_position_embeddings=64)
    model = make_random_model(arch, 3, torch.float32, torch.device("cpu"))
    for p in model.parameters():  # round to what the file stores, so the comparison is tight
        if p.dim() > 1:
            p.data = p.data.half().float()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, model)
    return model, path


def test_loads_unpermuted_and_tied(tiny, paged_run):
    model, path = tiny
    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    assert loaded.arch.rope_scaling == LLAMA3_SCALING
    assert loaded.arch.tie_word_embeddings and loaded.name == "tiny"
    ids = list(range(40))
    expected = paged_run(model, len(ids)).step([(ids, 0)])
    torch.testing.assert_close(paged_run(loaded.model, len(ids)).step([(ids, 0)]), expected,
                               atol=1e-5, rtol=1e-5)


def test_gguf_tokenizer(tiny):
    tok = load_tokenizer(str(tiny[1]))
    eot = TOKENS.index("<|im_end|>")
    assert tok.eos_token_ids == (TOKENS.index("<|endoftext|>"), eot)
    assert tok.encode("hello") == [TOKENS.index("hell"), TOKENS.index("o")]
    assert tok.encode("a12") == [TOKENS.index(c) for c in "a12"]
    assert tok.decode(tok.encode("hello world<|im_end|>"), skip_special_tokens=False) == \
        "hello world<|im_end|>"
    assert tok.decode(tok.encode("hi<|im_end|>")) == "hi"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"


def test_unknown_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        load_model(str(path), torch.float32, torch.device("cpu"))
