"""W8A8 checkpoints (compressed-tensors int-quantized / float-quantized, written by the
compressed-tensors package) and `--quantization int8|fp8` on a float checkpoint load as
W8A8Linear projections that compute what an independent reference computes, and stay close to
the float model of the same (dequantized) weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("compressed_tensors")

from tests.model.quant_checkpoints import tiny_llama, write_config  # noqa: E402
from tests.model.test_hf_loader import _save  # noqa: E402
from tests.model.w8a8_checkpoints import W8A8Spec, make_w8a8_checkpoints  # noqa: E402
from tinyvllm.model import load_model  # noqa: E402
from tinyvllm.model.quantization.layer import W8A8Linear  # noqa: E402

CPU = torch.device("cpu")
MERGED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
          "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}
SPECS = [W8A8Spec("int", "channel", True), W8A8Spec("int", "tensor", False),
         W8A8Spec("int", "channel", False), W8A8Spec("float", "channel", True),
         W8A8Spec("float", "tensor", False), W8A8Spec("float", "tensor", True)]
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
CT_DIVISOR = {torch.int8: 127.5, torch.float8_e4m3fn: 448.0}
"""compressed-tensors' dynamic scale max|x| / ((q_max - q_min) / 2), per type."""


def _spec_id(s: W8A8Spec) -> str:
    return f"{s.format}-{s.weights}-{'dynamic' if s.dynamic else 'static'}"


def reference_linear(x: torch.Tensor, parts: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The merged projection from the checkpoint's tensors: x quantized per token in float32 as
    compressed-tensors quantizes float32 activations (scale max|x| / ((q_max - q_min) / 2), a
    zero scale replaced by float32's eps; or the largest of the parts' static scales), then the
    products in float64. Float32, not float64: with / 127.5 a negative row maximum lands on the
    tie -127.5 exactly in float64, while in float32 the rounded scale decides -128 or -127."""
    dtype = parts[0]["weight"].dtype
    xf = x.float()
    if "input_scale" in parts[0]:
        s = torch.stack([p["input_scale"].float().reshape(()) for p in parts]).max()
    else:
        s = xf.abs().amax(-1, keepdim=True) / CT_DIVISOR[dtype]
        s = torch.where(s == 0, torch.finfo(torch.float32).eps, s)
    lo = -128.0 if dtype == torch.int8 else -QMAX[dtype]
    q = (xf / s).clamp(lo, QMAX[dtype])
    q = torch.round(q) if dtype == torch.int8 else q.to(dtype).float()
    w = torch.cat([p["weight"].double() * p["weight_scale"].double() for p in parts])
    return (q.double() @ w.t()) * s.double()


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_loaded_layers_compute_the_reference(spec, tmp_path):
    quant_dir, _, stored = make_w8a8_checkpoints(tmp_path, spec)
    net = load_model(str(quant_dir), torch.float32, CPU).model
    gen = torch.Generator().manual_seed(1)
    for i, layer in enumerate(net.model.layers):
        for ours, names in MERGED.items():
            module = layer.get_submodule(ours)
            assert isinstance(module, W8A8Linear)
            assert (module.input_scale is None) == spec.dynamic
            assert module.act_scale_divisor == CT_DIVISOR[module.qweight.dtype]
            parts = [stored[f"model.layers.{i}.{ours.split('.')[0]}.{p}"] for p in names]
            assert torch.equal(module.qweight, torch.cat([p["weight"] for p in parts]))
            x = torch.randn(5, module.in_features, generator=gen) * 2
            x[3] = 0  # an all-zero token stays zero
            out = module(x)
            assert out.dtype == torch.float32 and torch.equal(out[3], torch.zeros_like(out[3]))
            torch.testing.assert_close(out.double(), reference_linear(x, parts),
                                       atol=1e-5, rtol=1e-5)


def test_activation_quantization_equals_compressed_tensors_for_static_scales():
    """For a static scale, the package's own quantize() is the oracle of x -> int8 / fp8."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    from tinyvllm.ops.w8a8_linear import quantize_rows

    x = torch.randn(7, 96) * 3
    x[0, :4] = torch.tensor([0.5, 1.5, -2.5, 1000.0]) * 0.02  # ties and a clipped value
    for kind, dtype in (("int", torch.int8), ("float", torch.float8_e4m3fn)):
        args = QuantizationArgs(num_bits=8, type=kind, strategy="tensor", symmetric=True)
        scale = torch.tensor([0.02])
        theirs = quantize(x, scale, torch.zeros(1), args, dtype=dtype)
        ours, _ = quantize_rows(x, dtype, scale)
        assert torch.equal(ours.float(), theirs.float()), kind


@pytest.mark.parametrize("kind,dtype", [("int", torch.int8), ("float", torch.float8_e4m3fn)])
def test_dynamic_activation_quantization_equals_compressed_tensors(kind, dtype):
    """Dynamic per-token scales: the package's compute_dynamic_scales_and_zp (calculate_qparams,
    max|x| / ((q_max - q_min) / 2)) and quantize() are the oracle of the scales and of
    x -> int8 / fp8, bit for bit, on float32 activations as transformers passes them ([batch,
    seq, hidden]): rows of every magnitude, negative maxima. The "qmax" convention
    (max|x| / 127) quantizes int8 otherwise, and max|x| times the float32 reciprocal of the
    divisor (what CUDA computes for a tensor divided by a Python number) gives other scales on
    some rows."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from tinyvllm.ops.w8a8_linear import COMPRESSED_TENSORS_DIVISOR, quantize_rows

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 512, 96, generator=gen) * torch.logspace(-4, 4, 512)[:, None]
    x[0, :8, 0] = -x[0, :8].abs().amax(-1) * 2  # negative maxima: x / scale at about -127.5
    args = QuantizationArgs(num_bits=8, type=kind, strategy="token", symmetric=True,
                            dynamic=True)
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, torch.nn.Module())
    theirs = quantize(x, scale, zero_point, args, dtype=dtype)
    divisor = COMPRESSED_TENSORS_DIVISOR[dtype]
    ours, our_scale = quantize_rows(x.reshape(-1, 96), dtype, divisor=divisor)
    assert divisor == CT_DIVISOR[dtype]
    assert torch.equal(our_scale, scale.reshape(-1, 1))
    assert torch.equal(ours.view(torch.uint8), theirs.reshape(-1, 96).view(torch.uint8))
    absmax = x.reshape(-1, 96).abs().amax(-1, keepdim=True)
    assert not torch.equal(absmax * (1.0 / divisor), our_scale)
    if dtype == torch.int8:
        vllm, _ = quantize_rows(x.reshape(-1, 96), dtype, divisor=QMAX[dtype])
        assert not torch.equal(vllm, ours)


@pytest.mark.parametrize("spec", [W8A8Spec("int", "channel", True),
                                  W8A8Spec("float", "tensor", False)], ids=_spec_id)
def test_logits_and_greedy_tokens_follow_the_dequantized_float_model(spec, tmp_path, paged_run):
    """Only the activations' quantization differs from the float model of the dequantized
    weights: logits within 2% (int8, dynamic; measured 1.0%) / 8% (fp8, static; measured 4.3%)
    relative error (Frobenius norm over 37 positions), and the same greedy tokens on these
    prompts (argmax agrees at 97% / 89% of the positions above: the tiny random model's logits
    have near-ties, so other prompts may differ at one)."""
    from tinyvllm import LLM, SamplingParams

    quant_dir, ref_dir, _ = make_w8a8_checkpoints(tmp_path, spec)
    ids = list(range(3, 40))
    logits = paged_run(load_model(str(quant_dir), torch.float32, CPU).model, len(ids))
    ref = paged_run(load_model(str(ref_dir), torch.float32, CPU).model, len(ids))
    a, b = logits.step([(ids, 0)]), ref.step([(ids, 0)])
    assert ((a - b).norm() / b.norm()).item() < (0.02 if spec.kind == "int" else 0.08)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello world!", "The quick brown fox"]

    def greedy(path) -> list[list[int]]:
        llm = LLM(model=str(path), num_kv_blocks=32)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert greedy(quant_dir) == greedy(ref_dir)


@pytest.mark.parametrize("method,dtype,max_rel", [("int8", torch.int8, 0.03),
                                                  ("fp8", torch.float8_e4m3fn, 0.1)])
def test_quantization_flag_on_a_float_checkpoint(method, dtype, max_rel, tmp_path, paged_run):
    """Per-channel weight scales made at load (max|w_row| / 127 or 448), dynamic per-token
    activations; logits within 3% (int8; measured 1.5%) / 10% (fp8; measured 5.6%) relative
    error of the float model."""
    _save(tiny_llama().eval(), tmp_path)
    float_net = load_model(str(tmp_path), torch.float32, CPU).model
    net = load_model(str(tmp_path), torch.float32, CPU, quantization=method).model
    qkv = net.model.layers[1].self_attn.qkv_proj
    w = float_net.model.layers[1].self_attn.qkv_proj.weight
    assert isinstance(qkv, W8A8Linear) and qkv.qweight.dtype == dtype
    assert qkv.input_scale is None
    assert qkv.act_scale_divisor == QMAX[dtype]  # max|x| / 127 or 448, as vLLM
    torch.testing.assert_close(qkv.weight_scale, w.abs().amax(1) / QMAX[dtype])
    deq = qkv.qweight.float() * qkv.weight_scale[:, None]
    scale = qkv.weight_scale[:, None]
    # Rounding moves a value by at most half a step: int8 scale / 2; fp8 e4m3 (3 mantissa bits)
    # |w| / 16, and 2^-10 scale among the subnormals (below 2^-6 scale).
    bound = (scale / 2 if dtype == torch.int8
             else torch.maximum(w.abs() / 16, scale * 2.0 ** -10))
    assert bool(((deq - w).abs() <= bound * 1.0001).all())
    assert net.lm_head.weight.dtype == torch.float32  # lm_head stays float
    ids = list(range(3, 40))
    a = paged_run(net, len(ids)).step([(ids, 0)])
    b = paged_run(float_net, len(ids)).step([(ids, 0)])
    assert ((a - b).norm() / b.norm()).item() < max_rel


def test_synthetic_model_with_fp8_is_w8a8_from_the_random_float_weights():
    from tinyvllm.model.synthetic import (make_random_model, make_random_quantized_model,
                                          tiny_arch)

    arch = tiny_arch()
    net = make_random_quantized_model(arch, 3, torch.float32, CPU, "fp8")
    float_net = make_random_model(arch, 3, torch.float32, CPU)
    layers = [m for m in net.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 4 * arch.num_layers
    assert all(m.qweight.dtype == torch.float8_e4m3fn for m in layers)
    down, float_down = net.model.layers[1].mlp.down_proj, float_net.model.layers[1].mlp.down_proj
    torch.testing.assert_close(down.weight_scale, float_down.weight.abs().amax(1) / 448)
    x = torch.randn(3, down.in_features)
    y, ref = down(x), float_down(x)
    assert ((y - ref).norm() / ref.norm()).item() < 0.08


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_inputs_quantized_by_the_norm_and_swiglu_give_the_same_logits(method, monkeypatch,
                                                                      paged_run):
    """The decoder's fused path, where each W8A8 projection's input comes quantized from the
    RMSNorm (with the residual add) or SwiGLU before it (QuantizedRows; on CUDA one kernel),
    forced on here on the CPU, where it runs the ops' references: the logits of the CPU path,
    bit for bit, over a prefill and a decode step."""
    from tinyvllm.model.quantization import layer
    from tinyvllm.model.synthetic import make_random_quantized_model, tiny_arch

    net = make_random_quantized_model(tiny_arch(), 3, torch.float32, CPU, method)
    ids = list(range(3, 30))

    def run() -> torch.Tensor:
        seq = paged_run(net, len(ids))
        return torch.cat([seq.step([(ids[:-1], 0)]), seq.step([(ids[-1:], len(ids) - 1)])])

    unfused = run()
    asked = set()
    monkeypatch.setattr(layer, "input_quant_fusable",
                        lambda op, x, qweight, input_scale: asked.add(op) or input_scale is None)
    assert torch.equal(run(), unfused)
    assert asked == {"rms_norm_quant", "silu_and_mul_quant"}


# --- bad checkpoints fail at load, naming the tensor or key and the format ------------------------

def _edit_tensors(quant_dir, edit) -> None:
    path = quant_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("spec,edit,match", [
    (W8A8Spec(), lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"),
     r"model\.layers\.1\.mlp\.up_proj\.weight_scale: missing from the checkpoint "
     r"\(compressed-tensors \(int-quantized"),
    (W8A8Spec(), lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale":
                                     torch.ones(128, 2)}),
     r"o_proj\.weight_scale: expected float scales of shape \(128, 1\), got torch\.float32 "
     r"\(128, 2\)"),
    (W8A8Spec(), lambda t: t.update({"model.layers.0.mlp.down_proj.weight":
                                     t["model.layers.0.mlp.down_proj.weight"].half()}),
     r"down_proj\.weight: expected torch\.int8 \(128, 256\), got torch\.float16"),
    (W8A8Spec("float"), lambda t: t.update({"model.layers.0.mlp.down_proj.weight":
                                            t["model.layers.0.mlp.down_proj.weight"].view(
                                                torch.float8_e5m2)}),
     r"down_proj\.weight: expected torch\.float8_e4m3fn \(128, 256\), got torch\.float8_e5m2"),
    (W8A8Spec("int", dynamic=False),
     lambda t: t.pop("model.layers.0.self_attn.v_proj.input_scale"),
     r"v_proj\.input_scale: missing; static activation quantization"),
    (W8A8Spec("int", dynamic=True),
     lambda t: t.update({"model.layers.0.self_attn.v_proj.input_scale": torch.ones(1)}),
     r"v_proj\.input_scale: unexpected tensor; config\.json says the activations are "
     r"quantized dynamically"),
    (W8A8Spec("float", dynamic=False),
     lambda t: t.update({"model.layers.1.mlp.gate_proj.input_scale": torch.zeros(1)}),
     r"gate_proj\.input_scale: 0\.0, expected a positive scale"),
], ids=["missing-scale", "scale-shape", "weight-dtype", "fp8-e5m2", "missing-input-scale",
        "unexpected-input-scale", "zero-input-scale"])
def test_bad_tensors_are_named(spec, edit, match, tmp_path):
    quant_dir = make_w8a8_checkpoints(tmp_path, spec)[0]
    _edit_tensors(quant_dir, edit)
    with pytest.raises(ValueError, match=match):
        load_model(str(quant_dir), torch.float32, CPU)


def _group(acts: dict, **weights) -> dict:
    w = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False,
         "strategy": "channel", **weights}
    return {"targets": ["Linear"], "weights": w, "input_activations": acts}


_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}


@pytest.mark.parametrize("fmt,group,match", [
    ("int-quantized", _group({**_TOKEN, "symmetric": False}),
     r"asymmetric input_activations \(symmetric: false\) are not supported for W8A8"),
    ("int-quantized", _group({**_TOKEN, "type": "float"}),
     r"input_activations of 8-bit type 'float' are not supported in format 'int-quantized'"),
    ("int-quantized", _group(_TOKEN, num_bits=4),
     r"weights of 4-bit type 'int' are not supported"),
    ("int-quantized", _group({**_TOKEN, "strategy": "group", "group_size": 128}),
     r"input_activations of strategy 'group' / dynamic True are not supported"),
    ("int-quantized", _group(_TOKEN, strategy="group", group_size=64),
     r"weights of strategy 'group' / dynamic False are not supported for W8A8"),
    ("pack-quantized", _group(_TOKEN),
     r"format 'pack-quantized' with input_activations is not supported \(W8A8: int-quantized"),
    ("float-quantized", _group({**_TOKEN, "type": "float"}),
     r"weights of 8-bit type 'int' are not supported in format 'float-quantized'"),
], ids=["asym-acts", "mixed-types", "w4a8", "group-acts", "group-weights", "pack-w8a8",
        "int-weights-in-fp8"])
def test_unsupported_w8a8_configs_are_named(fmt, group, match, tmp_path):
    quant_dir = make_w8a8_checkpoints(tmp_path, W8A8Spec())[0]
    write_config(quant_dir, {"quant_method": "compressed-tensors", "format": fmt,
                             "ignore": ["lm_head"], "config_groups": {"group_0": group}})
    with pytest.raises(ValueError, match=r"compressed-tensors config_groups\.group_0: " + match):
        load_model(str(quant_dir), torch.float32, CPU)


def test_quantization_flag_int8_on_a_quantized_checkpoint_is_refused(tmp_path):
    quant_dir = make_w8a8_checkpoints(tmp_path, W8A8Spec())[0]
    with pytest.raises(ValueError, match=r"--quantization int8 quantizes a float checkpoint at "
                                         r"load; int-quantized is already a 'compressed-tensors'"):
        load_model(str(quant_dir), torch.float32, CPU, quantization="int8")
    net = load_model(str(quant_dir), torch.float32, CPU, quantization="compressed-tensors").model
    assert isinstance(net.model.layers[0].mlp.down_proj, W8A8Linear)
    assert json.loads((quant_dir / "config.json").read_text())["quantization_config"]


def test_two_ranks_match_one_on_w8a8(tmp_path):
    """Tensor parallelism: each rank keeps its rows of qkv / gate_up (and their scales) and its
    input columns of o / down (every row's scale). With static input scales (the whole
    projection's) the logits are one rank's. With dynamic per-token scales a row-parallel rank
    (o / down) scales its own slice of each token, as vLLM's ranks do: the logits differ from one
    rank's by quantization noise, here within 10% relative error (fp8)."""
    from tests.model.test_tensor_parallel import Case, _assert_matches, _greedy, _spawn

    quant_dir = make_w8a8_checkpoints(tmp_path / "ct", W8A8Spec("int", "channel", False))[0]
    float_dir = tmp_path / "float-for-fp8"
    _save(tiny_llama().eval(), float_dir)
    cases = {"ct-int8-static": Case(path=str(quant_dir)),
             "fp8-at-load": Case(path=str(float_dir), quantization="fp8")}
    ranks = _spawn(2, cases, tmp_path)
    for name, case in cases.items():
        model = case.build()
        assert isinstance(model.model.layers[0].self_attn.o_proj, W8A8Linear)
        assert torch.equal(ranks[1][name]["logits"], ranks[0][name]["logits"])
    _assert_matches("ct-int8-static", ranks, _greedy(cases["ct-int8-static"].build()))
    got = ranks[0]["fp8-at-load"]["logits"]
    want = _greedy(cases["fp8-at-load"].build())
    assert got.shape == want.shape and ((got - want).norm() / want.norm()).item() < 0.1


def test_naive_quantized_format_reads_as_its_weight_type(tmp_path):
    """compressed-tensors' generic naive-quantized compressor stores what int-quantized does."""
    quant_dir, _, stored = make_w8a8_checkpoints(tmp_path, W8A8Spec("int", "tensor", False))
    config = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
    write_config(quant_dir, {**config, "format": "naive-quantized"})
    down = load_model(str(quant_dir), torch.float32, CPU).model.model.layers[0].mlp.down_proj
    assert isinstance(down, W8A8Linear) and down.input_scale is not None
    assert torch.equal(down.qweight, stored["model.layers.0.mlp.down_proj"]["weight"])
