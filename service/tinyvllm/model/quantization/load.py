"""Filling a model's QuantLinear and W8A8Linear projections from a checkpoint's tensors.

Each checkpoint projection (q_proj, ..., down_proj) is read in its format (`formats.py`), its
columns sorted by group where act-order left them unsorted, packed once into `ops.quant_linear`'s
layout and written into its rows of the merged QuantLinear (qkv_proj: q, k, v stacked along n).
A W8A8 projection's 8-bit weight and scales are written into its rows of the W8A8Linear as they
are (a float weight under `--quantization int8|fp8` is quantized per channel first); the parts
of a merged projection share one static input scale, the largest of theirs (as vLLM does).
Everything else (norms, embeddings, lm_head, biases, float projections) loads as before.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from tinyvllm.model.quantization import formats
from tinyvllm.model.quantization.layer import (MERGED, W8A8_DTYPES, QuantLinear, W8A8Linear,
                                              use_tiles)
from tinyvllm.model.quantization.schemes import WeightScheme
from tinyvllm.ops.quant_linear import pack
from tinyvllm.ops.w8a8_linear import quantize_weight


def load_quantized_weights(net: nn.Module, weights: Iterable[tuple[str, Any]],
                           swapped: dict[str, WeightScheme]) -> set[str]:
    """`net.load_weights` over the float tensors, the QuantLinears (`swapped`, by our module
    name) filled from the packed ones; returns the names filled.

    Raises:
        ValueError: a missing, unexpected or mis-shaped tensor of a quantized projection, or
            act-order that the layout cannot hold, naming the tensor and the format.
    """
    parts = {f"{ours.rsplit('.', 1)[0]}.{part}": (ours, shard)
             for ours in swapped for shard, part in enumerate(MERGED[ours.rsplit(".", 1)[1]])}
    collected: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)

    def float_tensors() -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            module, _, leaf = name.rpartition(".")
            if module not in parts:
                yield name, tensor
            elif leaf != "bias":
                ours = parts[module][0]
                if swapped[ours].quantize_at_load and leaf == "weight":
                    collected[module].update(_quantize_at_load(net, ours, swapped[ours], tensor))
                else:
                    collected[module][leaf] = tensor[...]
            elif net.get_submodule(parts[module][0]).bias is None:
                _check_zero_bias(name, tensor[...])  # GPTQ writers may store a zero bias
            else:
                yield name, tensor

    loaded = net.load_weights(float_tensors())
    missing = sorted(set(parts) - set(collected))
    if missing:
        scheme = swapped[parts[missing[0]][0]]
        if scheme.quantize_at_load:
            raise ValueError(f"{missing[0]}.weight: missing from the checkpoint")
        required = ", ".join(formats.TENSORS[scheme.layout][0])
        raise ValueError(f"{missing[0]}: no quantized tensors ({required}) in the checkpoint, "
                         f"which config.json says is {scheme.method} ({scheme.layout})")
    # Per merged projection, what its parts must agree on: the act-order perm of a QuantLinear,
    # the static input scale of a W8A8Linear.
    shared: dict[str, dict[int, Optional[torch.Tensor]]] = defaultdict(dict)
    for module, tensors in collected.items():
        ours, shard = parts[module]
        fill = _fill_w8a8 if swapped[ours].w8a8 else _fill
        shared[ours][shard] = fill(net, ours, shard, module, swapped[ours], tensors)
    for ours, by_shard in shared.items():
        layer = net.get_submodule(ours)
        values = [by_shard[s] for s in sorted(by_shard)]
        if isinstance(layer, W8A8Linear):
            _set_input_scale(layer, values)
        else:
            _set_perm(layer, ours, values)
        loaded.add(ours)
    use_tiles(net)  # the decode GEMV's layout, on a GPU with the kernels
    return loaded


def _quantize_at_load(net: nn.Module, ours: str, scheme: WeightScheme, tensor: Any
                      ) -> dict[str, torch.Tensor]:
    """A float weight [n, k] as the W8A8 tensors a checkpoint would hold (`--quantization
    int8|fp8`): quantized on the layer's device, one scale per output channel over the whole
    row (before any tensor-parallel slicing, so that every rank gets one rank's values)."""
    device = net.get_submodule(ours).qweight.device
    qweight, scale = quantize_weight(tensor[...].to(device), W8A8_DTYPES[scheme.layout])
    return {"weight": qweight, "weight_scale": scale.view(-1, 1)}


def _shard(net: nn.Module, ours: str, shard: int
           ) -> tuple[slice, Optional[tuple[int, int, int, int]], int, int]:
    """(this part's rows of `ours`, this rank's part of the checkpoint tensor, the checkpoint
    projection's whole n and k)."""
    layer = net.get_submodule(ours)
    parent, merged = ours.rsplit(".", 1)
    sizes = (net.get_submodule(parent).shard_sizes(ours) if len(MERGED[merged]) > 1
             else [layer.out_features])
    start, n = sum(sizes[:shard]), sizes[shard]
    # Tensor parallelism: the checkpoint holds the whole projection; this rank keeps its rows
    # (column-parallel qkv / gate_up) or its input columns (row-parallel o / down).
    part = net._rank_part(ours, shard)  # (dim, start, length, whole length) or None
    n_whole = part[3] if part is not None and part[0] == 0 else n
    k_whole = part[3] if part is not None and part[0] == 1 else layer.in_features
    return slice(start, start + n), part, n_whole, k_whole


def _fill(net: nn.Module, ours: str, shard: int, module: str, scheme: WeightScheme,
          tensors: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """Write one checkpoint projection into its rows of `ours`; returns its act-order perm."""
    layer: QuantLinear = net.get_submodule(ours)
    rows, part, n_whole, k_whole = _shard(net, ours, shard)
    reader = formats.Reader(module, scheme, tensors, n_whole, k_whole)
    unpacked = _rank_slice(formats.read(reader), part, reader.group, module)
    values, perm = _sort_by_group(unpacked, layer.group_size, module)
    layer.qweight[rows] = pack(values, layer.bits).to(layer.qweight.device)
    layer.scales[rows] = unpacked.scales.to(layer.scales)
    layer.zeros[rows] = unpacked.zeros.to(layer.zeros)
    return perm


def _fill_w8a8(net: nn.Module, ours: str, shard: int, module: str, scheme: WeightScheme,
               tensors: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """Write one checkpoint projection into its rows of the W8A8Linear `ours`; returns its
    static input scale (None: dynamic)."""
    layer: W8A8Linear = net.get_submodule(ours)
    rows, part, n_whole, k_whole = _shard(net, ours, shard)
    w = formats.read_w8a8(formats.Reader(module, scheme, tensors, n_whole, k_whole))
    qweight, weight_scale = w.qweight, w.weight_scale
    if part is not None and part[0] == 0:
        qweight, weight_scale = (t[part[1]:part[1] + part[2]] for t in (qweight, weight_scale))
    elif part is not None:  # input columns; every output channel keeps its scale
        qweight = qweight[:, part[1]:part[1] + part[2]]
    layer.qweight[rows] = qweight.to(layer.qweight.device)
    layer.weight_scale[rows] = weight_scale.to(layer.weight_scale.device)
    return w.input_scale


def _set_input_scale(layer: W8A8Linear, scales: list[Optional[torch.Tensor]]) -> None:
    """One static input scale for the merged projection's parts, which read the same input: the
    largest, so that no part's activations clip where its own scale would not."""
    if layer.input_scale is not None:
        layer.input_scale.copy_(torch.stack(scales).max())


def _rank_slice(u: formats.Unpacked, part: Optional[tuple[int, int, int, int]], group: int,
                module: str) -> formats.Unpacked:
    """This rank's rows (dim 0) or input columns and their groups (dim 1) of a projection."""
    if part is None:
        return u
    dim, start, length, k = part
    if dim == 0:
        rows = slice(start, start + length)
        return formats.Unpacked(u.values[rows], u.scales[rows], u.zeros[rows], u.g_idx)
    if u.g_idx is not None and not torch.equal(u.g_idx, torch.arange(k) // group):
        raise ValueError(f"{module}.g_idx: act-order groups span the whole input, so this "
                         "row-parallel projection cannot be split for tensor parallelism")
    columns = slice(start, start + length)
    if u.scales.shape[1] == 1:  # per channel: every rank keeps the one group
        return formats.Unpacked(u.values[:, columns], u.scales, u.zeros, None)
    if start % group or length % group:
        raise ValueError(f"{module}: this rank's input columns [{start}, {start + length}) do "
                         f"not start and end on a group of {group} (tensor parallelism)")
    groups = slice(start // group, (start + length) // group)
    return formats.Unpacked(u.values[:, columns], u.scales[:, groups], u.zeros[:, groups], None)


def _sort_by_group(u: formats.Unpacked, group_size: int, module: str
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(values [n, k] with columns sorted by group, perm [k] or None where already sorted).

    Act-order (GPTQ desc_act) gives each group group_size columns anywhere in k; sorted by
    group, column j is in group j // group_size, as the layout wants, and x is read as x[perm].
    """
    k = u.values.shape[1]
    if u.g_idx is None or torch.equal(u.g_idx, torch.arange(k) // group_size):
        return u.values, None
    counts = torch.bincount(u.g_idx, minlength=k // group_size)
    if bool((counts != group_size).any()):
        raise ValueError(f"{module}.g_idx: groups of {counts.min()}..{counts.max()} columns; "
                         f"act-order needs {group_size} columns in each group")
    perm = torch.argsort(u.g_idx, stable=True)
    return u.values[:, perm], perm


def _set_perm(layer: QuantLinear, ours: str, perms: list[Optional[torch.Tensor]]) -> None:
    """One perm for the merged projection: its parts read the same input."""
    first = perms[0]
    for p in perms[1:]:
        if (p is None) != (first is None) or (p is not None and not torch.equal(p, first)):
            raise ValueError(f"{ours}: its parts have different act-order (g_idx) column "
                             "orders; a merged projection needs one")
    layer.perm = None if first is None else first.to(layer.qweight.device)


def _check_zero_bias(name: str, bias: torch.Tensor) -> None:
    if bool(bias.any()):
        raise ValueError(f"unexpected weight {name!r}: a nonzero bias on a projection this "
                         "architecture has without one")
