"""Checkpoints written by llm-compressor and auto-round (`make_tool_checkpoints.py`, a tiny
random Llama quantized on the CPU) load in tinyvllm and compute the logits of the tool's own
reference, and greedy decoding picks the same tokens.

The references, all in float32:
    llm-compressor   transformers with compressed-tensors' loader: `dequantize=True` (the float
                     weights) for W4A16; as saved for W8A8 / FP8, where compressed-tensors also
                     fake-quantizes each token's activations at run time
    auto-round gptq  auto-round's own torch QuantLinear over the same tensors applied to the
                     identity: its dequantized weight, in a float copy
    auto-round awq   auto-round's `dequantize_gemm` of the same tensors, in a float copy
Each tool is optional: its tests skip where it is not installed.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch
from safetensors.torch import load_file

from tests.model import make_tool_checkpoints as tools
from tinyvllm.model import load_model
from tinyvllm.model.quantization import QuantLinear

CPU = torch.device("cpu")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
MAX_TOKENS = 8
NEAR_TIE = 1e-4
"""Top-2 logit gap of the reference under which a different greedy token is a near-tie."""


@contextmanager
def _tool_warnings_ignored() -> Iterator[None]:
    """The tools warn about their own setup (offloading, deprecated arguments) on a CPU; the
    suite's warnings-are-errors is for tinyvllm's code."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Checkpoints:
    """The float model and each tool's checkpoints of it, made once per session on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Path] = {"float": tools.tiny_float_model(root / "float")}

    def __getitem__(self, name: str) -> Path:
        if name not in self.made:
            with _tool_warnings_ignored():
                self._make(name)
        return self.made[name]

    def _make(self, name: str) -> None:
        float_dir = self.made["float"]
        if name in tools.LLMCOMPRESSOR_SCHEMES:
            self.made[name] = tools.llmcompressor_checkpoint(
                float_dir, self.root / name, tools.LLMCOMPRESSOR_SCHEMES[name])
        elif name in tools.AUTOROUND_EXPORTS:  # one run, both exports
            self.made.update(tools.autoround_checkpoints(float_dir, tools.AUTOROUND_EXPORTS,
                                                         sym=False))
        else:
            self.made.update(tools.autoround_checkpoints(float_dir, {name: "auto_round"},
                                                         sym=True))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    pytest.importorskip("transformers")
    return Checkpoints(tmp_path_factory.mktemp("tool_checkpoints"))


# --- references -----------------------------------------------------------------------------------

def _prompt_ids(path: Path) -> list[list[int]]:
    from tinyvllm.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(path))
    return [tokenizer.encode(p) for p in PROMPTS]


def compressed_tensors_reference(path: Path, weight_only: bool):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    quant = CompressedTensorsConfig(dequantize=True) if weight_only else None
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                quantization_config=quant).eval()


def _float_copy(path: Path, weights: dict[str, torch.Tensor]):
    """The checkpoint's architecture in float32: its float tensors plus `weights` (the
    dequantized projections, by HF module name)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()
             if k.rsplit(".", 1)[1] in ("weight", "bias")}
    state.update({f"{module}.weight": w for module, w in weights.items()})
    model.load_state_dict(state, strict=True)
    return model.eval()


def autoround_gptq_reference(path: Path):
    """auto-round's torch QuantLinear for the GPTQ layout with stored zero - 1 (`auto_gptq`,
    `auto_round:auto_gptq`) over the same tensors, scales in float32, times the identity: its
    (q - zero) * scale. (Its own loader serves asymmetric ones on a CPU only through the
    auto-round-lib kernels, so the layer is built here.)"""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(path / "model.safetensors"))
    weights = {}
    for name in tensors:
        if name.endswith(".qweight"):
            module = name.rsplit(".", 1)[0]
            k = tensors[name].shape[0] * 32 // quant["bits"]
            n = tensors[f"{module}.scales"].shape[1]
            # Its g_idx path slices the output columns by in_features (wrong where out_features
            # is larger, as for gate_proj), so the trivial g_idx (desc_act false) is left out.
            g_idx = tensors.get(f"{module}.g_idx")
            assert g_idx is None or torch.equal(g_idx, torch.arange(k) // quant["group_size"])
            layer = QuantLinear(quant["bits"], quant["group_size"], k, n, bias=False)
            for buffer in ("qweight", "qzeros", "scales"):
                setattr(layer, buffer, tensors[f"{module}.{buffer}"])
            layer.scales = layer.scales.float()
            with torch.no_grad():
                weights[module] = layer(torch.eye(k)).t()
    return _float_copy(path, weights)


def autoround_awq_reference(path: Path):
    from auto_round.export.export_to_awq.utils import dequantize_gemm

    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(path / "model.safetensors"))
    weights = {}
    for name in tensors:
        if name.endswith(".qweight"):
            module = name.rsplit(".", 1)[0]
            weights[module] = dequantize_gemm(
                tensors[name], tensors[f"{module}.qzeros"], tensors[f"{module}.scales"].float(),
                quant["bits"], quant["group_size"]).t()
    return _float_copy(path, weights)


# --- comparisons ----------------------------------------------------------------------------------

def _our_logits(path: Path, ids: list[int], paged_run) -> tuple[torch.Tensor, torch.nn.Module]:
    net = load_model(str(path), torch.float32, CPU).model
    return paged_run(net, len(ids)).step([(ids, 0)]), net


def _reference_greedy(ref, ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of the reference and the top-2 logit gap at each step."""
    tokens, gaps = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = ref(torch.tensor([ids + tokens])).logits[0, -1]
            top = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            gaps.append(float(top[0] - top[1]))
    return tokens, gaps


def _assert_greedy_matches(path: Path, ref) -> None:
    """Our greedy tokens equal the reference's up to the first near-tie of the reference (after
    which the two may continue differently); the message names it."""
    from tinyvllm import LLM, SamplingParams

    llm = LLM(model=str(path), num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt_ids = _prompt_ids(path)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    for prompt, ids, out in zip(PROMPTS, prompt_ids, outputs):
        ours = list(out.outputs[0].token_ids)
        theirs, gaps = _reference_greedy(ref, ids)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        assert first is None or gaps[first] < NEAR_TIE, (
            f"{prompt!r}: token {first} differs ({ours} vs {theirs}) with a top-2 gap of "
            f"{gaps[first]:.2e}, not a near-tie")


def _check(path: Path, reference: Callable, paged_run, atol: float, rtol: float,
           layer_check: Optional[Callable[[torch.nn.Module], None]] = None) -> None:
    with _tool_warnings_ignored():
        ref = reference(path)
    for ids in _prompt_ids(path):
        ours, net = _our_logits(path, ids, paged_run)
        if layer_check is not None:
            layer_check(net)
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol)
    _assert_greedy_matches(path, ref)


def _packed(bits: int) -> Callable[[torch.nn.Module], None]:
    def check(net: torch.nn.Module) -> None:
        for layer in net.model.layers:
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj):
                assert isinstance(module, QuantLinear) and module.bits == bits
    return check


# Weight-only: both sides dequantize the same ints and scales exactly in float32; what is left
# is the order of float32 sums (measured: under 1e-6 of logits of about 1.5).
WEIGHT_ONLY_TOL = dict(atol=2e-5, rtol=1e-5)


# --- llm-compressor -------------------------------------------------------------------------------

def test_llmcompressor_gptq_w4a16(checkpoints, paged_run):
    pytest.importorskip("llmcompressor")
    path = checkpoints["llmcompressor-w4a16"]
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    weights = quant["config_groups"]["group_0"]["weights"]
    assert (quant["format"], weights["num_bits"], weights["group_size"]) == (
        "pack-quantized", 4, 128)
    _check(path, lambda p: compressed_tensors_reference(p, weight_only=True), paged_run,
           layer_check=_packed(4), **WEIGHT_ONLY_TOL)


@pytest.mark.parametrize("name", ["llmcompressor-w8a8", "llmcompressor-fp8"])
def test_llmcompressor_w8a8(name, checkpoints, paged_run):
    """Activations quantized per token at run time. Skipped while tinyvllm refuses the format
    at load (the W8A8 loader is not in yet); then it must compute what compressed-tensors'
    fake quantization computes."""
    pytest.importorskip("llmcompressor")
    path = checkpoints[name]
    try:
        load_model(str(path), torch.float32, CPU)
    except ValueError as e:
        if "not supported" not in str(e):
            raise
        pytest.skip(f"tinyvllm does not load this W8A8 checkpoint yet: {e}")
    # Rounding an activation that sits on a rounding boundary may differ between two correct
    # implementations by one step of that token's scale: allow a few 1e-3 of the logits.
    _check(path, lambda p: compressed_tensors_reference(p, weight_only=False), paged_run,
           atol=5e-3, rtol=1e-3)


# --- auto-round -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,reference,method", [
    ("autoround-gptq", autoround_gptq_reference, "gptq"),
    ("autoround-awq", autoround_awq_reference, "awq"),
    ("autoround", autoround_gptq_reference, "auto-round"),
])
def test_autoround(name, reference, method, checkpoints, paged_run):
    pytest.importorskip("auto_round")
    path = checkpoints[name]
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    assert (quant["quant_method"], quant["bits"], quant["group_size"]) == (method, 4, 128)
    _check(path, reference, paged_run, layer_check=_packed(4), **WEIGHT_ONLY_TOL)


def test_autoround_exports_of_one_quantization_agree(checkpoints, paged_run):
    """auto_gptq and auto_awq hold the same ints and scales in two layouts: our logits are
    bitwise the same for both."""
    pytest.importorskip("auto_round")
    ids = _prompt_ids(checkpoints["float"])[0]
    gptq, _ = _our_logits(checkpoints["autoround-gptq"], ids, paged_run)
    awq, _ = _our_logits(checkpoints["autoround-awq"], ids, paged_run)
    assert torch.equal(gptq, awq)
