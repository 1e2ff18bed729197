"""Finding the CUDA module. `cuda_ops()` is None when the module was not built or no GPU exists."""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Optional

import torch


@functools.cache
def cuda_ops() -> Optional[ModuleType]:
    if os.environ.get("TINYVLLM_DISABLE_CUDA_KERNELS") == "1" or not torch.cuda.is_available():
        return None
    try:
        from tinyvllm import _cuda
    except ImportError:
        return None
    return _cuda


def use_kernel(*tensors: torch.Tensor) -> Optional[ModuleType]:
    """The CUDA module if every tensor is on a CUDA device and the module exists, else None."""
    if not all(t.is_cuda for t in tensors):
        return None
    return cuda_ops()


def stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream
