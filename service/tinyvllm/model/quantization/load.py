"""Filling a model's QuantLinear projections from a checkpoint's packed tensors.

Each checkpoint projection (q_proj, ..., down_proj) is read in its format (`formats.py`), its
columns sorted by group where act-order left them unsorted, packed once into `ops.quant_linear`'s
layout and written into its rows of the merged QuantLinear (qkv_proj: q, k, v stacked along n).
Everything else (norms, embeddings, lm_head, biases, float projections) loads as before.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from tinyvllm.model.quantization import formats
from tinyvllm.model.quantization.layer import MERGED, QuantLinear
from tinyvllm.model.quantization.schemes import WeightScheme
from tinyvllm.ops.quant_linear import pack


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
                collected[module][leaf] = tensor[...]
            elif net.get_submodule(parts[module][0]).bias is None:
                _check_zero_bias(name, tensor[...])  # GPTQ writers may store a zero bias
            else:
                yield name, tensor

    loaded = net.load_weights(float_tensors())
    missing = sorted(set(parts) - set(collected))
    if missing:
        scheme = swapped[parts[missing[0]][0]]
        required = ", ".join(formats.TENSORS[scheme.layout][0])
        raise ValueError(f"{missing[0]}: no quantized tensors ({required}) in the checkpoint, "
                         f"which config.json says is {scheme.method} ({scheme.layout})")
    perms: dict[str, dict[int, Optional[torch.Tensor]]] = defaultdict(dict)
    for module, tensors in collected.items():
        ours, shard = parts[module]
        perms[ours][shard] = _fill(net, ours, shard, module, swapped[ours], tensors)
    for ours, by_shard in perms.items():
        _set_perm(net.get_submodule(ours), ours, [by_shard[s] for s in sorted(by_shard)])
        loaded.add(ours)
    return loaded


def _fill(net: nn.Module, ours: str, shard: int, module: str, scheme: WeightScheme,
          tensors: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """Write one checkpoint projection into its rows of `ours`; returns its act-order perm."""
    layer: QuantLinear = net.get_submodule(ours)
    parent, merged = ours.rsplit(".", 1)
    sizes = (net.get_submodule(parent).shard_sizes(ours) if len(MERGED[merged]) > 1
             else [layer.out_features])
    start, n = sum(sizes[:shard]), sizes[shard]
    # Tensor parallelism: the checkpoint holds the whole projection; this rank keeps its rows
    # (column-parallel qkv / gate_up) or its input columns (row-parallel o / down).
    part = net._rank_part(ours, shard)  # (dim, start, length, whole length) or None
    n_whole = part[3] if part is not None and part[0] == 0 else n
    k_whole = part[3] if part is not None and part[0] == 1 else layer.in_features
    reader = formats.Reader(module, scheme, tensors, n_whole, k_whole)
    unpacked = _rank_slice(formats.read(reader), part, reader.group, module)
    values, perm = _sort_by_group(unpacked, layer.group_size, module)
    rows = slice(start, start + n)
    layer.qweight[rows] = pack(values, layer.bits).to(layer.qweight.device)
    layer.scales[rows] = unpacked.scales.to(layer.scales)
    layer.zeros[rows] = unpacked.zeros.to(layer.zeros)
    return perm


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
