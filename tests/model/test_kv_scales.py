"""FP8 KV-cache scales on the attention modules: defaults, checkpoint names, bad values."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.model.synthetic import make_random_model, tiny_arch


@pytest.fixture
def model():
    return make_random_model(tiny_arch(), seed=0, dtype=torch.bfloat16,
                             device=torch.device("cpu"))


def scales(model) -> list[tuple[float, float]]:
    return [(float(layer.self_attn.k_scale), float(layer.self_attn.v_scale))
            for layer in model.model.layers]


def test_default_scales_are_one_float32_buffers(model):
    attn = model.model.layers[0].self_attn
    assert attn.k_scale.dtype == attn.v_scale.dtype == torch.float32  # not the model's bf16
    assert attn.k_scale.shape == ()
    assert scales(model) == [(1.0, 1.0)] * 2
    assert "model.layers.0.self_attn.k_scale" not in model.state_dict()  # not a weight
    assert not any("k_scale" in name for name in model.expected_weight_names())


@pytest.mark.parametrize("k_name,v_name", [
    ("self_attn.k_scale", "self_attn.v_scale"),  # vLLM / llm-compressor
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),  # AutoFP8
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
])
def test_checkpoint_scales_are_loaded(model, k_name, v_name):
    loaded = model.load_weights([
        (f"model.layers.1.{k_name}", torch.tensor(0.25)),
        (f"model.layers.1.{v_name}", torch.tensor([0.5], dtype=torch.bfloat16)),
    ])
    assert scales(model) == [(1.0, 1.0), (0.25, 0.5)]
    assert loaded == {"model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"}


def test_kv_scale_sets_both(model):
    model.load_weights([("model.layers.0.self_attn.kv_scale", torch.tensor(0.125))])
    assert scales(model) == [(0.125, 0.125), (1.0, 1.0)]


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), [0.5, 0.5]])
def test_bad_scale_raises_naming_the_weight(model, value):
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_scale"):
        model.load_weights([("model.layers.0.self_attn.k_scale", torch.tensor(value))])


def test_unknown_layer_raises(model):
    with pytest.raises(KeyError, match="layers.7"):
        model.load_weights([("model.layers.7.self_attn.v_scale", torch.tensor(1.0))])
