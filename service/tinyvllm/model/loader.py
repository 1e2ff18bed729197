"""Loading a model: Hugging Face safetensors directories and GGUF files. Never through pickle."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from tinyvllm.distributed import get_tp
from tinyvllm.model.arch import SUPPORTED_GGUF_ARCHITECTURES, LlamaArch
from tinyvllm.model.llama import LlamaForCausalLM, build_empty_model
from tinyvllm.model.quantization import (load_quantized_weights, parse_quantization_config,
                                         swap_in_quant_linears)
from tinyvllm.model.synthetic import (SYNTHETIC_MODELS, make_random_model,
                                      make_random_quantized_model)
from tinyvllm.model_files import is_gguf, model_name, read_gguf, resolve_model_path
from tinyvllm.tokenization import Tokenizer, tokenizer_from_gguf_metadata, tokenizer_from_hf_dir
from tinyvllm.tokenization.synthetic import synthetic_tokenizer

__all__ = ["LoadedModel", "load_model"]

logger = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_GGUF_ROPE_FREQS = "rope_freqs.weight"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: LlamaArch
    tokenizer: Tokenizer
    name: str
    path: Path
    max_model_len: int
    """The model's context length (`arch.max_position_embeddings`)."""


def load_model(model: Optional[str], dtype: torch.dtype, device: torch.device,
               seed: int = 0, packed: bool = False,
               quantization: Optional[str] = None) -> LoadedModel:
    """Load weights, architecture and tokenizer of a .gguf file or a HF directory (None: default).

    A name in `synthetic.SYNTHETIC_MODELS` (`llama3-8b-shape`) builds that shape with random
    weights made on `device` from `seed`, and a byte-level stand-in tokenizer; no file is read.

    packed=True keeps a GGUF file's Q4_0 / Q4_1 / Q8_0 projections as the file's blocks for the
    CPU kernels or the CUDA block GEMV, and Q4_K / Q5_K / Q6_K ones for the CPU kernels
    (`model/packed.py`); where that cannot serve (not CPU
    float32 or GPU 16-bit, no kernels, more than one tensor-parallel rank) the weights are
    dequantized as usual, with a log line saying why.

    A HF directory with a weight-only `quantization_config` (GPTQ, AWQ, compressed-tensors
    pack-quantized, AutoRound: `model/quantization/`) keeps its projections packed as QuantLinear
    modules, a W8A8 one (compressed-tensors int-quantized / float-quantized) as W8A8Linear
    modules; `quantization` (`--quantization`) must then name the checkpoint's method, if given.
    `quantization` int8 or fp8 on a float checkpoint (or a synthetic model) quantizes every
    projection to W8A8 at load.

    Under tensor parallelism (`tinyvllm.distributed.init_tensor_parallel` first) the model is
    this rank's part, and each rank reads only its slices of a safetensors checkpoint.

    Raises:
        FileNotFoundError: missing path or default package (see resolve_model_path).
        ValueError: unsupported architecture or weight type, or missing/mis-shaped weights.
    """
    if model in SYNTHETIC_MODELS:
        return _load_synthetic(model, dtype, torch.device(device), seed, quantization)
    path = resolve_model_path(model)
    device = torch.device(device)
    if is_gguf(path) and quantization is not None:
        raise ValueError(f"--quantization {quantization}: {path.name} is a GGUF file (its own "
                         "quantization types load as they are)")
    if is_gguf(path) and packed:
        from tinyvllm.model.packed import load_gguf_packed, packed_unsupported

        reason = packed_unsupported(dtype, device, get_tp().size)
        if reason is None:
            return load_gguf_packed(path, device, dtype)
        logger.info("%s: dequantizing the weights: %s", path.name, reason)
    quant = None
    if is_gguf(path):
        arch, tokenizer, weights, count = _open_gguf(path)
    else:
        arch, tokenizer, weights, count, quant = _open_hf_dir(path, quantization)
    swapped: dict = {}
    net = build_empty_model(arch, dtype, device, prepare=None if quant is None else
                            lambda m: swapped.update(swap_in_quant_linears(m, quant)))
    weights = tqdm(weights, total=count, desc=f"Loading {path.name}", unit="tensor", leave=False)
    try:
        loaded = (load_quantized_weights(net, weights, swapped) if swapped
                  else net.load_weights(weights))
    except KeyError as e:  # a tensor no Llama parameter matches: a format we do not read
        raise ValueError(f"{path.name}: {e.args[0]}; this checkpoint's format or architecture "
                         "variant is not supported") from None
    missing = net.expected_weight_names() - loaded
    if missing:
        raise ValueError(f"{path.name}: missing weights {sorted(missing)[:8]}")
    return LoadedModel(model=net, arch=arch, tokenizer=tokenizer, name=model_name(path), path=path,
                       max_model_len=arch.max_position_embeddings)


def _load_synthetic(name: str, dtype: torch.dtype, device: torch.device, seed: int,
                    quantization: Optional[str] = None) -> LoadedModel:
    """With `quantization` int8 / fp8: every projection W8A8, quantized from the random float
    weights; any other method name: every projection random W4A16, group 128."""
    arch = SYNTHETIC_MODELS[name]
    if quantization is not None:
        if get_tp().size > 1:
            raise ValueError(f"--quantization {quantization}: the synthetic model {name!r} is "
                             "quantized on one rank only")
        net = make_random_quantized_model(arch, seed, dtype, device, quantization)
    else:
        net = make_random_model(arch, seed, dtype, device)
    return LoadedModel(model=net, arch=arch, tokenizer=synthetic_tokenizer(arch.vocab_size, name),
                       name=name, path=Path(name), max_model_len=arch.max_position_embeddings)


# --- Hugging Face directory ----------------------------------------------------------------------

def _open_hf_dir(path: Path, quantization: Optional[str] = None):
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    # Formats we do not read (bitsandbytes, FP8, ...) are refused by name before any tensor.
    quant = parse_quantization_config(config, quantization, path.name)
    arch = LlamaArch.from_hf_config(config, name=model_name(path))
    files = _safetensors_files(path)
    tokenizer = tokenizer_from_hf_dir(path)
    tokenizer.vocab_size = arch.vocab_size
    count = sum(len(_safetensors_keys(f)) for f in files)
    return arch, tokenizer, _iter_safetensors(files), count, quant


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path.name}: no *.safetensors weights (pickled .bin weights "
                                "are not loaded, for safety)")
    return files


def _safetensors_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice): `load_weights` reads the part of each tensor that its rank holds."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # old checkpoints saved the rope buffer; we compute it
                yield name, f.get_slice(name)


# --- GGUF ----------------------------------------------------------------------------------------

def _open_gguf(path: Path):
    reader, meta = read_gguf(path)
    check_gguf_architecture(meta, path)
    tensors = {t.name: t for t in reader.tensors}
    freqs = tensors.get(_GGUF_ROPE_FREQS)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path.name}: no token_embd.weight tensor; not a Llama-family GGUF")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # ggml order: [hidden, vocab]
    arch = LlamaArch.from_gguf_metadata(
        meta, set(tensors), vocab_size,
        rope_freq_factors=None if freqs is None else dequantize_gguf_tensor(freqs))
    tokenizer = tokenizer_from_gguf_metadata(meta, vocab_size=vocab_size, name=model_name(path))
    # llama.cpp permutes q/k rows for its interleaved rope only for the `llama` architecture.
    permuted = meta["general.architecture"] == "llama"
    weights = [t for name, t in tensors.items() if name != _GGUF_ROPE_FREQS]
    return arch, tokenizer, _iter_gguf(weights, arch, permuted), len(weights)


def check_gguf_architecture(meta: dict, path: Path) -> None:
    """Raises ValueError naming `general.architecture` when it is not one we run."""
    arch = meta.get("general.architecture", "<missing>")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{path.name}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")


def _iter_gguf(tensors: list, arch: LlamaArch, permuted: bool):
    # Whole tensors, dequantized, even for a tensor-parallel rank that keeps a slice
    # (`load_weights` narrows it): every rank dequantizes the whole file, once, at load. Cutting
    # the rank's rows out of the quantized blocks first would read less.
    for t in tensors:
        name = _gguf_to_hf_name(t.name)
        weight = torch.from_numpy(dequantize_gguf_tensor(t))
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rope_rows(weight, arch.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rope_rows(weight, arch.num_kv_heads)
        yield name, weight


def _gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def gguf_supported_types() -> tuple[str, ...]:
    """Every GGUF weight type the `gguf` package can dequantize (F32, F16, BF16, Q4_0..Q8_0,
    the K-quants Q2_K..Q6_K, the IQ types, ...): whatever its version supports, we load."""
    import gguf

    return ("F32", "F16", *(t.name for t in gguf.quants._type_traits))


def dequantize_gguf_tensor(t: Any) -> np.ndarray:
    """float32 array in the row-major (PyTorch) shape of a GGUF tensor.

    Raises:
        ValueError: a type the `gguf` package cannot dequantize, naming tensor and type.
    """
    import gguf

    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {t.name!r} has unsupported type {t.tensor_type.name} "
                         f"(supported: {', '.join(gguf_supported_types())})") from None
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists dims fastest-first
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    # F32 tensors come back as views of the read-only memory map; torch wants writable memory.
    return values if values.flags.writeable else values.copy()


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's converter permutation of q/k rows (HF half-split -> interleaved rope).

    The converter does, per head, rows [h, 2, d/2] -> [h, d/2, 2]; we go back.
    Shape: weight [num_heads * head_dim, ...] (a bias is [num_heads * head_dim]).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape))
