"""Pieces of the tensor-parallel model (`tinyvllm.distributed`): the vocabulary-parallel
embedding, and reading one rank's part of a checkpoint tensor."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.distributed import TensorParallel


def vocab_rows(vocab_size: int, tp_size: int) -> int:
    """Rows of the vocabulary on each rank: the vocabulary padded to a multiple of the size."""
    return -(-vocab_size // tp_size)


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's contiguous slice of the padded vocabulary (all of it at
    size 1). Each id's row lives on one rank; the others contribute zeros to the all-reduce.

    Shape: weight [vocab_rows(vocab_size, tp.size), embedding_dim]
    """

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        rows = vocab_rows(vocab_size, tp.size)
        self.vocab_start = tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] int64 -> [..., embedding_dim]."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


def read_part(hf_name: str, tensor: Any,
              part: Optional[tuple[int, int, int, int]]) -> torch.Tensor:
    """The checkpoint tensor (a torch tensor or a safetensors lazy slice, which reads only the
    indexed part from the file), whole or narrowed to part = (dim, start, length, whole length).

    Raises:
        ValueError: the tensor's length along dim is not the whole model's.
    """
    if part is None:
        return tensor[...]
    dim, start, length, whole = part
    shape = tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
    if len(shape) <= dim or shape[dim] != whole:
        raise ValueError(f"weight {hf_name!r}: shape {shape}, expected {whole} along dim {dim}")
    return tensor[(slice(None),) * dim + (slice(start, start + length),)]
