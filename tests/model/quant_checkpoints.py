"""Tiny weight-only quantized Llama checkpoints, packed here the way each tool writes them
(AutoGPTQ / GPTQModel, AutoAWQ GEMM, compressed-tensors pack-quantized, AutoRound), beside the
same model saved unquantized with the dequantized weights.

The packers follow the tools' own code, independently of the loader under test: GPTQ packs
`intweight[row * pf + t] << bits * t` into qweight[row] ([k, n] -> [k / pf, n]) and zeros along
n (zero - 1 for the v1 `gptq` format); AWQ packs columns col * 8 + ORDER[i] into nibble i of a
word along n; compressed-tensors stores the signed value + 2^(bits-1), 32 / bits values a word
along k (zero points along n).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.model.test_hf_loader import _save

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJ_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in",
              "o_proj": "o_in", "gate_proj": "mlp_in", "up_proj": "mlp_in",
              "down_proj": "down_in"}
"""Projections that read the same input share one act-order g_idx (as GPTQ's Hessian makes)."""


@dataclass(frozen=True)
class Spec:
    fmt: str             # gptq, gptq_v2, awq, ct, auto-round-gptq, auto-round, auto-round-awq
    bits: int = 4
    group_size: int = 32  # -1: per channel
    sym: bool = True
    desc_act: bool = False


@dataclass
class Quantized:
    q: torch.Tensor       # [n, k] unsigned ints
    zeros: torch.Tensor   # [n, G] ints (the zero point itself)
    scales: torch.Tensor  # [n, G] float16
    g_idx: torch.Tensor   # [k] int

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.q.float() - self.zeros[:, g].float()) * self.scales[:, g].float()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))


def random_quantized(n: int, k: int, spec: Spec, g_idx: torch.Tensor,
                     gen: torch.Generator) -> Quantized:
    levels = 1 << spec.bits
    groups = k // (k if spec.group_size == -1 else spec.group_size)
    q = torch.randint(0, levels, (n, k), generator=gen)
    if spec.sym:
        zeros = torch.full((n, groups), levels // 2)
    else:
        zeros = torch.randint(1, levels, (n, groups), generator=gen)
    scales = (0.04 / levels * (0.5 + torch.rand(n, groups, generator=gen))).half()
    return Quantized(q, zeros, scales, g_idx)


def make_g_idx(k: int, spec: Spec, gen: torch.Generator) -> torch.Tensor:
    group = k if spec.group_size == -1 else spec.group_size
    g_idx = torch.arange(k) // group
    if spec.desc_act:  # act-order: the group of a column is its rank in a random order
        order = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // group
    return g_idx.int()


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """[..., pf] unsigned values -> [...] int32 words, value t at bits t * bits."""
    out = np.zeros(values.shape[:-1], dtype=np.uint32)
    for t in range(values.shape[-1]):
        out |= values[..., t].astype(np.uint32) << np.uint32(bits * t)
    return out.view(np.int32)


def pack_gptq(qz: Quantized, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    pf = 32 // bits
    intweight = qz.q.t().numpy()  # [k, n]
    k, n = intweight.shape
    qweight = _words(intweight.reshape(k // pf, pf, n).transpose(0, 2, 1), bits)
    zeros = (qz.zeros.t().numpy() - int(v1))  # [G, n]
    qzeros = _words(zeros.reshape(zeros.shape[0], n // pf, pf), bits)
    return {"qweight": torch.from_numpy(qweight.copy()), "qzeros": torch.from_numpy(qzeros),
            "scales": qz.scales.t().contiguous(), "g_idx": qz.g_idx.int().clone()}


def pack_awq(qz: Quantized) -> dict[str, torch.Tensor]:
    def pack(cols: np.ndarray) -> torch.Tensor:  # [rows, n] -> [rows, n / 8]
        rows, n = cols.shape
        v = cols.reshape(rows, n // 8, 8)[:, :, AWQ_PACK_ORDER]
        return torch.from_numpy(_words(v, 4))
    return {"qweight": pack(qz.q.t().numpy()), "qzeros": pack(qz.zeros.t().numpy()),
            "scales": qz.scales.t().contiguous()}


def pack_compressed_tensors(qz: Quantized, bits: int, sym: bool) -> dict[str, torch.Tensor]:
    pf, offset = 32 // bits, 1 << (bits - 1)
    n, k = qz.q.shape
    # The tool quantizes to signed q - offset (zero point z - offset) and stores it + offset.
    signed = qz.q.numpy() - offset
    packed = _words((signed + offset).reshape(n, k // pf, pf), bits)
    out = {"weight_packed": torch.from_numpy(packed), "weight_scale": qz.scales.clone(),
           "weight_shape": torch.tensor([n, k])}
    if not sym:  # signed zero point (z - offset), stored + offset, packed along n
        zp = (qz.zeros.numpy() - offset) + offset  # [n, G]
        words = _words(zp.T.reshape(zp.shape[1], n // pf, pf), bits).T
        out["weight_zero_point"] = torch.from_numpy(np.ascontiguousarray(words))
    return out


def quantization_config(spec: Spec) -> dict:
    base = {"bits": spec.bits, "group_size": spec.group_size}
    if spec.fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", **base, "desc_act": spec.desc_act, "sym": spec.sym,
                "checkpoint_format": spec.fmt}
    if spec.fmt == "awq":
        return {"quant_method": "awq", **base, "zero_point": True, "version": "gemm"}
    if spec.fmt.startswith("auto-round"):
        packing = {"auto-round-gptq": "auto_round:auto_gptq", "auto-round": "auto_round",
                   "auto-round-awq": "auto_round:auto_awq"}[spec.fmt]
        return {"quant_method": "auto-round", "packing_format": packing, **base,
                "sym": spec.sym, "data_type": "int", "act_bits": 16}
    weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym, "dynamic": False,
               "strategy": "channel" if spec.group_size == -1 else "group",
               "group_size": None if spec.group_size == -1 else spec.group_size,
               "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}}}


def pack(qz: Quantized, spec: Spec) -> dict[str, torch.Tensor]:
    if spec.fmt in ("gptq", "auto-round-gptq"):
        return pack_gptq(qz, spec.bits, v1=True)
    if spec.fmt in ("gptq_v2", "auto-round"):
        return pack_gptq(qz, spec.bits, v1=False)
    if spec.fmt in ("awq", "auto-round-awq"):
        return pack_awq(qz)
    return pack_compressed_tensors(qz, spec.bits, spec.sym)


def make_checkpoints(root: Path, spec: Spec, seed: int = 0
                     ) -> tuple[Path, Path, dict[str, Quantized]]:
    """(quantized dir, float dir with the dequantized weights, {projection: Quantized})."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    ref_dir, quant_dir = root / "float", root / spec.fmt
    ref_dir.mkdir(parents=True)
    _save(tiny_llama().eval(), ref_dir)
    (file,) = ref_dir.glob("*.safetensors")
    tensors = load_file(str(file))
    quantized: dict[str, Quantized] = {}
    packed: dict[str, torch.Tensor] = {}
    g_idx: dict[tuple[str, str], torch.Tensor] = {}
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        proj = module.rsplit(".", 1)[-1]
        if proj not in PROJ_INPUT or leaf != "weight":
            packed[name] = tensors[name]
            continue
        n, k = tensors[name].shape
        key = (module.rsplit(".", 2)[0], PROJ_INPUT[proj])
        g = g_idx.setdefault(key, make_g_idx(k, spec, gen))
        qz = quantized[module] = random_quantized(n, k, spec, g, gen)
        tensors[name] = qz.dequantize()
        packed.update({f"{module}.{t}": v for t, v in pack(qz, spec).items()})
    save_file(tensors, str(file))
    quant_dir.mkdir()
    for f in ref_dir.iterdir():
        if f.suffix != ".safetensors":
            (quant_dir / f.name).write_bytes(f.read_bytes())
    save_file(packed, str(quant_dir / "model.safetensors"))
    write_config(quant_dir, quantization_config(spec))
    return quant_dir, ref_dir, quantized


def write_config(directory: Path, quant: Optional[dict]) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant is not None:
        config["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(config))
