"""Weight-only quantized checkpoints in each format load packed (QuantLinear) and compute what
the same model saved with the dequantized weights computes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.quant_checkpoints import (Spec, make_checkpoints, pack_compressed_tensors,
                                           write_config)
from tinyvllm.model import load_model
from tinyvllm.model.quantization import QuantLinear
from tinyvllm.ops.quant_linear import dequantize

CPU = torch.device("cpu")
SPECS = [
    Spec("gptq", bits=4, group_size=32),
    Spec("gptq", bits=4, group_size=32, sym=False, desc_act=True),
    Spec("gptq", bits=4, group_size=128, desc_act=True),
    Spec("gptq", bits=8, group_size=-1, sym=False),
    Spec("gptq_v2", bits=4, group_size=64, desc_act=True),
    Spec("gptq_v2", bits=8, group_size=32, sym=False),
    Spec("awq", bits=4, group_size=64, sym=False),
    Spec("ct", bits=4, group_size=32),
    Spec("ct", bits=4, group_size=128, sym=False),
    Spec("ct", bits=8, group_size=-1),
    Spec("auto-round-gptq", bits=4, group_size=32),
    Spec("auto-round", bits=4, group_size=64, sym=False),
    Spec("auto-round-awq", bits=4, group_size=32, sym=False),
]
MERGED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
          "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


def _spec_id(s: Spec) -> str:
    group = "pc" if s.group_size == -1 else f"g{s.group_size}"
    return (f"{s.fmt}-w{s.bits}-{group}-{'sym' if s.sym else 'asym'}"
            f"{'-act_order' if s.desc_act else ''}")


def _weight(layer: QuantLinear) -> torch.Tensor:
    """The layer's dequantized weight [n, k] with its columns back in the checkpoint's order."""
    w = dequantize(layer.qweight, layer.scales, layer.zeros, layer.bits, layer.group_size)
    return w if layer.perm is None else w[:, torch.argsort(layer.perm)]


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_loaded_layers_equal_the_checkpoints_dequantization(spec, tmp_path, paged_run):
    quant_dir, ref_dir, quantized = make_checkpoints(tmp_path, spec)
    net = load_model(str(quant_dir), torch.float32, CPU).model
    for i, layer in enumerate(net.model.layers):
        for ours, parts in MERGED.items():
            module = layer.get_submodule(ours)
            assert isinstance(module, QuantLinear) and module.bits == spec.bits
            # act-order sorts columns where there is more than one group
            groups = module.in_features // module.group_size
            assert (module.perm is not None) == (spec.desc_act and groups > 1)
            parent = ours.split(".")[0]
            expected = torch.cat([quantized[f"model.layers.{i}.{parent}.{p}"].dequantize()
                                  for p in parts])
            assert torch.equal(_weight(module), expected), (i, ours)
    ref = load_model(str(ref_dir), torch.float32, CPU).model
    ids = list(range(3, 40))
    logits = paged_run(net, len(ids)).step([(ids, 0)])
    torch.testing.assert_close(logits, paged_run(ref, len(ids)).step([(ids, 0)]),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", [Spec("gptq", group_size=64, sym=False, desc_act=True),
                                  Spec("awq", group_size=32, sym=False)], ids=_spec_id)
def test_greedy_tokens_equal_the_dequantized_checkpoints(spec, tmp_path):
    from tinyvllm import LLM, SamplingParams

    quant_dir, ref_dir, _ = make_checkpoints(tmp_path, spec)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello world!", "The quick brown fox"]

    def greedy(path) -> list[list[int]]:
        llm = LLM(model=str(path), num_kv_blocks=32)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert greedy(quant_dir) == greedy(ref_dir)


def test_bfloat16_keeps_the_activation_dtype(tmp_path):
    quant_dir, _, _ = make_checkpoints(tmp_path, Spec("gptq", sym=False))
    net = load_model(str(quant_dir), torch.bfloat16, CPU).model
    qkv = net.model.layers[0].self_attn.qkv_proj
    assert qkv.scales.dtype == qkv.zeros.dtype == torch.bfloat16
    assert qkv.qweight.dtype == torch.int32 and net.lm_head.weight.dtype == torch.bfloat16
    out = qkv(torch.randn(3, qkv.in_features, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (3, qkv.out_features)


def test_compressed_tensors_package_reads_our_test_checkpoints_the_same(tmp_path):
    """The real compressed-tensors packer and decompressor as the oracle of the layout."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationScheme

    for spec in (Spec("ct", bits=4, group_size=32, sym=False), Spec("ct", bits=8,
                                                                     group_size=-1)):
        quant_dir, _, quantized = make_checkpoints(tmp_path / _spec_id(spec), spec)
        config = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
        scheme = QuantizationScheme(**config["config_groups"]["group_0"])
        tensors = load_file(str(quant_dir / "model.safetensors"))
        net = load_model(str(quant_dir), torch.float32, CPU).model
        prefix = "model.layers.1.mlp.down_proj"
        qz = quantized[prefix]
        ours = pack_compressed_tensors(qz, spec.bits, spec.sym)
        offset = 1 << (spec.bits - 1)
        theirs = pack_to_int32((qz.q - offset).to(torch.int8), spec.bits)
        assert torch.equal(ours["weight_packed"], theirs)
        if not spec.sym:
            assert torch.equal(ours["weight_zero_point"], pack_to_int32(
                (qz.zeros - offset).to(torch.int8), spec.bits, packed_dim=0))
        state = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(prefix)}
        weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        # It multiplies in the scales' float16; ours (exact in float32) rounds to the same.
        assert weight.dtype == torch.float16
        assert torch.equal(_weight(net.model.layers[1].mlp.down_proj).half(), weight)


# --- bad checkpoints fail at load, naming the tensor or key and the format ------------------------

def _quant_dir(tmp_path, spec=Spec("gptq", sym=False)):
    return make_checkpoints(tmp_path, spec)[0]


def _edit_tensors(quant_dir, edit) -> None:
    path = quant_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _edit_config(quant_dir, **changes) -> None:
    quant = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
    write_config(quant_dir, {**quant, **changes})


@pytest.mark.parametrize("changes,match", [
    ({"bits": 3}, r"gptq: bits 3 is not supported \(supported: 4, 8\)"),
    ({"group_size": 48}, r"self_attn\.qkv_proj: .*group_size 48"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not supported"),
    ({"lm_head": True}, r"quantized lm_head"),
], ids=["bits", "group_size", "checkpoint_format", "lm_head"])
def test_unsupported_gptq_config_is_named(changes, match, tmp_path):
    quant_dir = _quant_dir(tmp_path)
    _edit_config(quant_dir, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(str(quant_dir), torch.float32, CPU)


def test_desc_act_without_g_idx_names_the_tensor(tmp_path):
    quant_dir = _quant_dir(tmp_path, Spec("gptq", desc_act=True))
    _edit_tensors(quant_dir, lambda t: [t.pop(k) for k in list(t) if k.endswith(".g_idx")])
    with pytest.raises(ValueError, match=r"layers\.\d\.\w+\.\w+_proj\.g_idx: missing; desc_act"):
        load_model(str(quant_dir), torch.float32, CPU)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.scales"),
     r"model\.layers\.1\.mlp\.up_proj\.scales: missing from the checkpoint \(gptq"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.qweight":
                         t["model.layers.0.self_attn.o_proj.qweight"][:8]}),
     r"o_proj\.qweight: expected torch\.int32 \(16, 128\), got torch\.int32 \(8, 128\)"),
    (lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.0.mlp.down_proj.")],
     r"model\.layers\.0\.mlp\.down_proj: no quantized tensors \(qweight, qzeros, scales\)"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.bias": torch.ones(128)}),
     r"down_proj\.bias.*nonzero bias"),
], ids=["missing-scales", "qweight-shape", "missing-projection", "nonzero-bias"])
def test_bad_tensors_are_named(edit, match, tmp_path):
    quant_dir = _quant_dir(tmp_path)
    _edit_tensors(quant_dir, edit)
    with pytest.raises(ValueError, match=match):
        load_model(str(quant_dir), torch.float32, CPU)


def test_act_order_that_differs_inside_a_merged_projection_is_refused(tmp_path):
    quant_dir = _quant_dir(tmp_path, Spec("gptq", desc_act=True))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    _edit_tensors(quant_dir, lambda t: t.update({name: t[name].flip(0).contiguous()}))
    with pytest.raises(ValueError, match=r"qkv_proj: its parts have different act-order"):
        load_model(str(quant_dir), torch.float32, CPU)


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
     r"awq: version 'gemv' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "dynamic": True}}}},
     r"weights of 4-bit type 'int' are not supported in format 'int-quantized' \(8-bit int\)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     r"'bitsandbytes' quantized checkpoints .* not supported; supported: gptq, awq"),
], ids=["awq-gemv", "ct-w4a8", "bitsandbytes"])
def test_unsupported_formats_are_named(quant, match, tmp_path):
    quant_dir = _quant_dir(tmp_path)
    write_config(quant_dir, quant)
    with pytest.raises(ValueError, match=match):
        load_model(str(quant_dir), torch.float32, CPU)


def test_quantization_flag_must_match_the_checkpoint(tmp_path):
    quant_dir, ref_dir, _ = make_checkpoints(tmp_path, Spec("awq", sym=False))
    net = load_model(str(quant_dir), torch.float32, CPU, quantization="awq").model
    assert isinstance(net.model.layers[0].mlp.down_proj, QuantLinear)
    with pytest.raises(ValueError, match=r"--quantization gptq: awq is a 'awq' checkpoint"):
        load_model(str(quant_dir), torch.float32, CPU, quantization="gptq")
    with pytest.raises(ValueError, match=r"--quantization gptq: float has no "
                                         "quantization_config"):
        load_model(str(ref_dir), torch.float32, CPU, quantization="gptq")


def test_two_ranks_match_one_on_quantized_checkpoints(tmp_path):
    """Tensor parallelism: each rank keeps its rows of qkv / gate_up and its input columns (and
    their groups) of o / down, and the logits are one rank's."""
    from tests.model.test_tensor_parallel import Case, _assert_matches, _greedy, _spawn

    cases = {}
    for spec in (Spec("gptq", group_size=32, sym=False), Spec("ct", bits=8, group_size=-1)):
        quant_dir, _, _ = make_checkpoints(tmp_path / _spec_id(spec), spec)
        cases[_spec_id(spec)] = Case(path=str(quant_dir))
    ranks = _spawn(2, cases, tmp_path)
    for name, case in cases.items():
        model = case.build()
        assert isinstance(model.model.layers[0].self_attn.o_proj, QuantLinear)
        _assert_matches(name, ranks, _greedy(model))


def test_synthetic_model_with_quantization_is_random_w4a16():
    from tinyvllm.model.loader import load_model
    from tinyvllm.model.quantization import QuantLinear
    from tinyvllm.ops.quant_linear import dequantize

    loaded = load_model("smollm2-135m-shape", torch.float32, torch.device("cpu"), seed=3,
                        quantization="gptq")
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * loaded.arch.num_layers
    layer = layers[0]
    assert (layer.bits, layer.group_size) == (4, 64)  # 128 does not divide 576
    w = dequantize(layer.qweight, layer.scales, layer.zeros, 4, 64)
    assert 0.01 < w.std().item() < 0.03  # the float synthetic model's spread (0.02)
    out = layer(torch.randn(2, layer.in_features))
    assert out.shape == (2, layer.out_features) and torch.isfinite(out).all()
    norm = loaded.model.model.layers[0].input_layernorm
    assert not torch.equal(norm, torch.ones_like(norm))  # the float parts were loaded too
