"""The decoder stack of a packed model in one C++ call per step (`_cpu.decoder_layers`).

At batch 1 the op-by-op module path spends more time in Python and torch per op (about 25 ops per
layer) than in the projections themselves. `PackedDecoder` hands the kernels every layer's
weights once, as pointers, and runs a step's norms, projections, rotary, K/V writes, attention and
SwiGLU in C++ (core_cpp/cpu/decoder.cpp). It computes what the module path computes over the same
packed weights, with the same int8 activation rounding (per 32 values, per 256 for the K-quants)
and the same projection kernels; float summation orders elsewhere differ, so results agree to a
few ulps before the rounding, and occasionally one int8 step after it.

It serves only what it was built for: a single-rank Llama whose every projection is a
`PackedLinear` the CPU kernels read (`ops.quantized.KERNEL_TYPES` and `KQUANT_TYPES`; qkv and
gate_up may be `PackedShards` of such parts, one type a shard) with no bias but qkv's, float32
activations and a contiguous
float32 or float16 KV cache (float16 by default here: `ops.kv_cache.resolve_kv_cache_dtype`); the
model falls back to the module path for anything else, and always without the kernels
(`TINYVLLM_DISABLE_CPU_KERNELS=1`) or with `--dequantize`.
"""

from __future__ import annotations

from typing import Optional

import torch

from tinyvllm import ops
from tinyvllm.ops import quantized as q
from tinyvllm.ops.kv_cache import CPU_KERNEL_KV_DTYPES, kv_dtype_name

LAYER_FIELDS = 23
"""Integers per layer in the kernel's table (core_cpp/cpu/bindings.cpp, kLayerFields)."""
QKV_SHARDS, GATE_UP_SHARDS = 3, 2
"""Shards of one type each the table holds for qkv (q, k, v) and gate_up (gate, up)."""


class PackedDecoder:
    """Runs `net`'s decoder layers and final norm through the fused C++ step.

    Build it with `PackedDecoder.for_model(net)`, which returns None when the model is not
    fully packed.
    """

    def __init__(self, net) -> None:
        self.net = net
        a = net.rank_arch
        self.dims = [a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
                     a.intermediate_size]
        self.eps, self.scale = float(a.rms_norm_eps), float(a.head_dim ** -0.5)
        self._table: Optional[list[int]] = None
        self._table_key: Optional[tuple[int, ...]] = None

    @classmethod
    def for_model(cls, net) -> Optional["PackedDecoder"]:
        if net.tp.size != 1 or not net.model.layers:
            return None
        for layer in net.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = {attn.qkv_proj: QKV_SHARDS, attn.o_proj: 1, mlp.gate_up_proj: GATE_UP_SHARDS,
                     mlp.down_proj: 1}
            if not all(_shards(p, most) is not None for p, most in projs.items()):
                return None
            if any(p.bias is not None for p in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                return None
        return cls(net)

    def serves(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this step can run fused (else the module path runs it)."""
        cache = kv_caches[0] if kv_caches else None
        return (q.cpu_kernels() is not None and hidden.dtype == torch.float32
                and hidden.device.type == "cpu" and hidden.dim() == 2 and cache is not None
                and cache.dtype in CPU_KERNEL_KV_DTYPES and cache.device.type == "cpu"
                and all(c.is_contiguous() for c in kv_caches)
                and self.net.cos_sin_cache.shape[-1] == self.dims[3])

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: ops.AttentionMetadata) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] embeddings (overwritten: the residual stream) ->
        [num_tokens, hidden_size] after the final norm, as `LlamaForCausalLM.forward`; runs the
        first len(kv_caches) layers (a layer-truncated self-draft passes its own few)."""
        net = self.net
        residual = hidden if hidden.is_contiguous() else hidden.contiguous()
        out = torch.empty_like(residual)
        num_tokens = residual.shape[0]
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        qsl = meta.query_start_loc.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        if positions.shape[0] < num_tokens or slots.shape[0] < num_tokens:
            raise ValueError(f"positions and slot_mapping must cover the {num_tokens} tokens")
        cache = kv_caches[0]
        cos_sin = net.cos_sin_cache
        q.cpu_kernels().decoder_layers(
            residual.data_ptr(), out.data_ptr(), self._layer_table(kv_caches),
            net.model.norm.data_ptr(), self.dims, self.eps, self.scale, num_tokens,
            positions.data_ptr(), slots.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0],
            qsl.data_ptr(), seq_lens.data_ptr(), meta.num_seqs, tables.data_ptr(),
            tables.shape[1] if tables.dim() == 2 else 0, cache.shape[1], cache.shape[2],
            kv_dtype_name(cache.dtype))
        return out

    def _layer_table(self, kv_caches: list[torch.Tensor]) -> list[int]:
        """The kernel's per-layer pointers for the first len(kv_caches) layers (all of them, or a
        layer-truncated self-draft's); rebuilt when a cache or weight moved."""
        layers = self.net.model.layers
        if not 1 <= len(kv_caches) <= len(layers):
            raise ValueError(f"expected 1 to {len(layers)} KV caches, got {len(kv_caches)}")
        layers = layers[:len(kv_caches)]
        first = layers[0]
        key = (tuple(c.data_ptr() for c in kv_caches),
               _shards(first.self_attn.qkv_proj, QKV_SHARDS)[0].qweight.data_ptr(),
               first.input_layernorm.data_ptr())
        if key != self._table_key:
            self._table = [v for layer, cache in zip(layers, kv_caches)
                           for v in _layer_fields(layer, cache)]
            self._table_key = key
        return self._table


def _shards(proj, most: int) -> Optional[list]:
    """proj's PackedLinear parts of one kernel-read type each (a PackedLinear alone, or a
    PackedShards' parts; at most `most`), or None when the fused step cannot run it."""
    from tinyvllm.model.packed import PackedLinear, PackedShards

    parts = list(proj.parts) if isinstance(proj, PackedShards) else [proj]
    readable = (*q.KERNEL_TYPES.values(), *q.KQUANT_TYPES.values())
    if len(parts) > most or not all(isinstance(p, PackedLinear) and p.qtype in readable
                                    for p in parts):
        return None
    return parts  # a PackedShards' parts carry no bias: the stack's is on proj


def _layer_fields(layer, kv_cache: torch.Tensor) -> list[int]:
    attn, mlp = layer.self_attn, layer.mlp

    def packed(p) -> list[int]:
        return [p.qweight.data_ptr(), p.qtype]

    def shards(proj, count: int) -> list[int]:
        parts = _shards(proj, count)
        fields = [v for p in parts for v in (*packed(p), p.out_features)]
        return fields + [0, 0, 0] * (count - len(parts))

    qkv_bias = attn.qkv_proj.bias
    fields = [layer.input_layernorm.data_ptr(), *shards(attn.qkv_proj, QKV_SHARDS),
              0 if qkv_bias is None else qkv_bias.data_ptr(), *packed(attn.o_proj),
              layer.post_attention_layernorm.data_ptr(), *shards(mlp.gate_up_proj, GATE_UP_SHARDS),
              *packed(mlp.down_proj), kv_cache.data_ptr()]
    assert len(fields) == LAYER_FIELDS
    return fields
