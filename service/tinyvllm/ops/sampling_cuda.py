"""The CUDA sampling kernel (`cuda/sampling.cuh`) behind `ops.sampling.sample`."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from tinyvllm.ops._dispatch import stream_handle

MAX_SPLITS = 16        # cuda/sampling.cuh kMaxSplits: CTAs per row for single-pass rows
PARTIAL_BYTES = 8      # sampling::Partial (float score, int index)
MAX_VOCAB_SIZE = (1 << 20) - 1  # fixed-point masses stay below 2^64


def sample_cuda(kernel, logits: torch.Tensor, temperature: torch.Tensor,
                top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                min_p: Optional[torch.Tensor], seed: Optional[torch.Tensor],
                offset: Optional[torch.Tensor], noise: Optional[torch.Tensor],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row, without a host sync; `logits` is only read.

    Shape: as `ops.sampling.sample`; logits and noise may also broadcast one row to all
    (row stride 0). `out` is an optional [num_rows] int64 buffer.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected float32 [num_rows, vocab_size] with contiguous rows, "
                         f"got {logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    num_rows, vocab_size = logits.shape
    if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"logits: vocab_size {vocab_size} outside [1, {MAX_VOCAB_SIZE}]")
    _check_rows("temperature", temperature, torch.float32, logits)
    for name, t, dtype in (("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32),
                           ("min_p", min_p, torch.float32), ("seed", seed, torch.int64),
                           ("offset", offset, torch.int64)):
        if t is not None:
            _check_rows(name, t, dtype, logits)
    if noise is None and (seed is None or offset is None):
        raise ValueError("seed, offset: required when no noise tensor is given")
    if noise is not None and (noise.dtype != torch.float32 or noise.shape != logits.shape
                              or noise.stride(1) != 1 or noise.device != logits.device):
        raise ValueError(f"noise: expected float32 {tuple(logits.shape)} with contiguous rows on "
                         f"{logits.device}, got {noise.dtype} {tuple(noise.shape)} on "
                         f"{noise.device}")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (num_rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous int64 [{num_rows}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    workspace = torch.empty(num_rows * MAX_SPLITS * PARTIAL_BYTES, dtype=torch.uint8,
                            device=logits.device)
    kernel.sample(out=out.data_ptr(), workspace=workspace.data_ptr(),
                  workspace_bytes=workspace.numel(), logits=logits.data_ptr(),
                  logits_stride=logits.stride(0), num_rows=num_rows, vocab_size=vocab_size,
                  temperature=temperature.data_ptr(), top_k=_ptr(top_k), top_p=_ptr(top_p),
                  min_p=_ptr(min_p), seed=_ptr(seed), offset=_ptr(offset), noise=_ptr(noise),
                  noise_stride=0 if noise is None else noise.stride(0),
                  stream=stream_handle(logits.device))
    return out


def argmax_cuda(kernel, logits: torch.Tensor) -> torch.Tensor:
    """The greedy path of `sample_cuda` on every row: temperature 0, no filters, no noise."""
    zeros = _zeros(logits.device, logits.shape[0])
    return sample_cuda(kernel, logits, zeros.temperature, None, None, None, zeros.seed_offset,
                       zeros.seed_offset, None)


class _Zeros(NamedTuple):
    temperature: torch.Tensor  # [num_rows] float32
    seed_offset: torch.Tensor  # [num_rows] int64 (read, never written, by the kernel)


@functools.lru_cache(maxsize=32)
def _zeros(device: torch.device, num_rows: int) -> _Zeros:
    """Zeroed per-row parameters (temperature, seed, offset) of a greedy launch, kept per batch
    size: nothing is uploaded per step."""
    return _Zeros(torch.zeros(num_rows, dtype=torch.float32, device=device),
                  torch.zeros(num_rows, dtype=torch.int64, device=device))


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype, logits: torch.Tensor) -> None:
    """t is a contiguous [num_rows] tensor of dtype on logits' device."""
    if (t.dtype != dtype or t.shape != (logits.shape[0],) or not t.is_contiguous()
            or t.device != logits.device):
        raise ValueError(f"{name}: expected contiguous {dtype} [{logits.shape[0]}] on "
                         f"{logits.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
