"""Models with random weights: benchmarks at real shapes without downloads, and tiny test models."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch

from tinyvllm.distributed import TensorParallel
from tinyvllm.model.arch import LlamaArch
from tinyvllm.model.llama import LlamaForCausalLM, build_empty_model
from tinyvllm.model_files import SYNTHETIC_MODEL_VOCAB_SIZES

WEIGHT_STD = 0.02
"""Standard deviation of random projection and embedding weights (HF's initializer_range)."""
NORM_JITTER = 0.05
"""Norm weights are 1 +- this, so that a wrong norm weight still shows in tests."""

LLAMA3_8B_SHAPE = LlamaArch(
    hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
    name="llama3-8b-random")

SMOLLM2_135M_SHAPE = LlamaArch(
    hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, max_position_embeddings=8192, name="smollm2-135m-random")


def tiny_arch(**overrides: Any) -> LlamaArch:
    """A two-layer GQA model small enough for CPU tests; override any field."""
    base = LlamaArch(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=256, rope_theta=10000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=512, name="tiny-random")
    return dataclasses.replace(base, **overrides)


SYNTHETIC_QUANT_BITS, SYNTHETIC_QUANT_GROUP = 4, 128
"""A synthetic model with `--quantization`: every projection W4A16, group 128 (halved until it
divides every projection's k: 64 for the SmolLM2 shape), zero point 8."""


@torch.no_grad()
def make_random_quantized_model(arch: LlamaArch, seed: int, dtype: torch.dtype,
                                device: torch.device, method: str = "gptq") -> LlamaForCausalLM:
    """`make_random_model` with each projection a QuantLinear of random 4-bit values (group 128 or
    less, zero point 8, scales giving the float model's weight spread), made on `device`: timing of
    the quantized kernels at real shapes without a file. One rank only.

    method int8 / fp8 (`--quantization`): each projection a W8A8Linear instead, quantized on
    `device` from `make_random_model`'s float weights (the same seed gives the same weights)."""
    from tinyvllm.model.quantization import QuantizationConfig, WeightScheme, swap_in_quant_linears
    from tinyvllm.model.quantization.layer import use_tiles
    from tinyvllm.model.quantization.schemes import QUANTIZE_AT_LOAD
    from tinyvllm.ops.quant_linear import pack

    if method in QUANTIZE_AT_LOAD:
        return _make_random_w8a8_model(arch, seed, dtype, torch.device(device), method)

    group = SYNTHETIC_QUANT_GROUP
    while any(k % group for k in (arch.hidden_size, arch.q_size, arch.intermediate_size)):
        group //= 2
    scheme = WeightScheme(layout="gptq", bits=SYNTHETIC_QUANT_BITS, group_size=group, sym=True,
                          method="synthetic")
    config = QuantizationConfig(method="synthetic", scheme_for=lambda name: scheme)
    device = torch.device(device)
    swapped: dict = {}
    model = build_empty_model(arch, dtype, device, TensorParallel(),
                              prepare=lambda m: swapped.update(swap_in_quant_linears(m, config)))
    generator = torch.Generator(device=device).manual_seed(seed)
    zero = float(1 << (SYNTHETIC_QUANT_BITS - 1))
    spread = WEIGHT_STD / 4.6  # the standard deviation of q - 8 for q uniform in 0..15
    for name, module in model.named_modules():
        if name not in swapped:
            continue
        q = torch.randint(0, 1 << SYNTHETIC_QUANT_BITS, (module.out_features, module.in_features),
                          generator=generator, device=device, dtype=torch.int32)
        module.qweight.copy_(pack(q, SYNTHETIC_QUANT_BITS))
        module.scales.uniform_(0.5 * spread, 1.5 * spread, generator=generator)
        module.zeros.fill_(zero)
    model.load_weights((n, t) for n, t in random_weights(arch, seed, dtype, device)
                       if _float_part(n, swapped))
    use_tiles(model)  # the decode GEMV's layout, on a GPU with the kernels
    return model


def _make_random_w8a8_model(arch: LlamaArch, seed: int, dtype: torch.dtype,
                            device: torch.device, method: str) -> LlamaForCausalLM:
    """The random float model's tensors through the `--quantization int8|fp8` loader."""
    from tinyvllm.model.quantization import load_quantized_weights, swap_in_quant_linears
    from tinyvllm.model.quantization.schemes import quantize_at_load

    config = quantize_at_load(method)
    swapped: dict = {}
    model = build_empty_model(arch, dtype, device, TensorParallel(),
                              prepare=lambda m: swapped.update(swap_in_quant_linears(m, config)))
    load_quantized_weights(model, random_weights(arch, seed, dtype, device), swapped)
    return model


def _float_part(name: str, swapped: dict) -> bool:
    """Whether checkpoint tensor `name` is not one of the swapped projections' weights."""
    parent = name.rsplit(".", 1)[0]
    merged = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    head, _, proj = parent.rpartition(".")
    return f"{head}.{merged.get(proj, proj)}" not in swapped


@torch.no_grad()
def make_random_model(arch: LlamaArch, seed: int, dtype: torch.dtype, device: torch.device,
                      tp: Optional[TensorParallel] = None) -> LlamaForCausalLM:
    """Random weights generated on `device` from `seed` (same seed, same device -> same weights).

    A tensor-parallel rank (`tp`, default `get_tp()`) gets its slices of the same weights: every
    tensor is generated whole and `load_weights` narrows it.
    """
    device = torch.device(device)
    model = build_empty_model(arch, dtype, device, tp)
    model.load_weights(random_weights(arch, seed, dtype, device))
    return model


def random_weights(arch: LlamaArch, seed: int, dtype: torch.dtype,
                   device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's random tensors, drawn in parameter order, under checkpoint names."""
    with torch.device("meta"):
        whole = LlamaForCausalLM(arch, TensorParallel())
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in whole.named_parameters():
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        if param.dim() == 1 and "bias" not in name:  # RMSNorm weights
            tensor.uniform_(1 - NORM_JITTER, 1 + NORM_JITTER, generator=generator)
        else:
            tensor.normal_(0.0, WEIGHT_STD, generator=generator)
        yield from checkpoint_tensors(name, tensor, arch)


_UNMERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_tensors(name: str, tensor: torch.Tensor,
                       arch: LlamaArch) -> Iterator[tuple[str, torch.Tensor]]:
    """A parameter of a one-rank model of `arch` as the HF-named tensors `load_weights` reads:
    merged projections split into their parts, norms as `<norm>.weight`."""
    module, leaf = name.rsplit(".", 1)
    if leaf.endswith("norm"):  # input_layernorm, post_attention_layernorm, model.norm
        yield f"{name}.weight", tensor
        return
    parent, _, proj = module.rpartition(".")
    if proj not in _UNMERGED:
        yield name, tensor
        return
    sizes = ([arch.q_size, arch.kv_size, arch.kv_size] if proj == "qkv_proj"
             else [arch.intermediate_size] * 2)
    for part_name, part in zip(_UNMERGED[proj], tensor.split(sizes), strict=True):
        yield f"{parent}.{part_name}.{leaf}", part


# --- named synthetic models (`--model llama3-8b-shape`) ------------------------------------------

SYNTHETIC_MODELS = {"llama3-8b-shape": LLAMA3_8B_SHAPE, "smollm2-135m-shape": SMOLLM2_135M_SHAPE}
"""Names that `load_model` builds from a seed instead of reading a file (timing at real shapes)."""
# The frontend knows these names and vocabularies without torch (their tokenizer is synthetic).
assert {name: arch.vocab_size for name, arch in SYNTHETIC_MODELS.items()} == \
    SYNTHETIC_MODEL_VOCAB_SIZES
