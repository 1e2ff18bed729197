"""Finding the CUDA module, and which of its kernels the GPU can run.

`cuda_ops()` is None when the module was not built, no GPU exists, or the GPU runs none of the
kernels. Otherwise each op asks `use_kernel(op, ...)`: the check against the device's compute
capability runs once, at the first call (the model runner makes it at start), and every op the
GPU cannot run is named in one warning and falls back to its torch reference.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from types import ModuleType
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

Capability = tuple[int, int]

# Op -> the lowest compute capability its kernels run on. Every kernel needs sm_80: the prefill
# attention is built on mma.sync bf16 tiles, ldmatrix and cp.async, and the module is compiled for
# sm_80 and newer only (CMakeLists.txt). Hopper-only instructions (griddepcontrol for programmatic
# dependent launch, cp.async.bulk prefetch) are compiled out below sm_90 and the kernels stay
# correct without them, so they raise no op's minimum.
KERNEL_MIN_CAPABILITY: dict[str, Capability] = {
    "paged_attention": (8, 0),
    "reshape_and_cache": (8, 0),
    "rms_norm": (8, 0),
    "silu_and_mul": (8, 0),
    "rotary_embedding": (8, 0),
    "rotary_embedding_and_cache": (8, 0),
    "fused_linear": (8, 0),
    "sample": (8, 0),
    "rejection_sample": (8, 0),
}


@dataclasses.dataclass(frozen=True)
class KernelSupport:
    """Which ops run their CUDA kernel on one device."""

    capability: Capability
    """The device's compute capability (major, minor)."""
    enabled: frozenset[str]
    """Ops whose kernel runs."""
    disabled: dict[str, str]
    """Ops that fall back to the torch reference -> why."""


def image_runs_on(arch: str, capability: Capability) -> bool:
    """Whether code compiled for one CMake CUDA architecture runs on a device.

    `arch` is a CMAKE_CUDA_ARCHITECTURES entry: "80" (SASS and PTX), "89-real" (SASS only) or
    "80-virtual" (PTX only); an "a" suffix ("90a") marks architecture-specific code. SASS runs on
    the same major version at an equal or higher minor; PTX is compiled by the driver for any
    device at least as new; "a" code of either kind runs only on exactly that version.
    """
    name, _, kind = arch.partition("-")
    specific = name.endswith("a")
    number = int(name.rstrip("af"))
    built = (number // 10, number % 10)
    if specific:
        return capability == built
    sass = kind in ("", "real") and capability[0] == built[0] and capability[1] >= built[1]
    ptx = kind in ("", "virtual") and capability >= built
    return sass or ptx


def kernel_support(capability: Capability, archs: Optional[Sequence[str]],
                   min_capability: Optional[dict[str, Capability]] = None) -> KernelSupport:
    """Split the ops into those whose kernel runs on `capability` and those that fall back.

    Args:
        capability: the device's (major, minor).
        archs: the architectures the module was compiled for; None when unknown (then only the
            ops' minimum capabilities count).
        min_capability: op -> lowest capability (default KERNEL_MIN_CAPABILITY).
    """
    table = KERNEL_MIN_CAPABILITY if min_capability is None else min_capability
    cc = f"{capability[0]}.{capability[1]}"
    if archs is not None and not any(image_runs_on(a, capability) for a in archs):
        why = f"the module was compiled for {';'.join(archs)}, nothing that runs on {cc}"
        return KernelSupport(capability, frozenset(), {op: why for op in table})
    disabled = {op: f"needs compute capability {m[0]}.{m[1]}, the device has {cc}"
                for op, m in table.items() if capability < m}
    return KernelSupport(capability, frozenset(table) - frozenset(disabled), disabled)


_ARCH = re.compile(r"^\d+[af]?(-real|-virtual)?$")


def module_archs(module: ModuleType) -> Optional[list[str]]:
    """The CUDA architectures the module was built for (its `cuda_archs`); None when it does not
    say, or names them in a way only CMake resolves ("native", "all")."""
    archs = [a for a in (getattr(module, "cuda_archs", None) or "").replace(";", ",").split(",")
             if a]
    return archs if archs and all(_ARCH.match(a) for a in archs) else None


def warn_fallbacks(support: KernelSupport, device_name: str) -> None:
    """One warning naming every op that runs its torch reference instead of its kernel."""
    if not support.disabled:
        return
    reasons = sorted(set(support.disabled.values()))
    logger.warning(
        "CUDA kernels unavailable on %s (compute capability %d.%d): %s run their torch "
        "reference instead, which is much slower (%s)", device_name, *support.capability,
        ", ".join(sorted(support.disabled)), "; ".join(reasons))


@functools.cache
def _cuda_module() -> Optional[ModuleType]:
    if os.environ.get("TINYVLLM_DISABLE_CUDA_KERNELS") == "1" or not torch.cuda.is_available():
        return None
    try:
        from tinyvllm import _cuda
    except ImportError:
        return None
    return _cuda


@functools.cache
def device_support() -> Optional[KernelSupport]:
    """The ops the current GPU runs (checked once, warning about the rest); None without one."""
    module = _cuda_module()
    if module is None:
        return None
    capability = torch.cuda.get_device_capability()
    support = kernel_support(capability, module_archs(module))
    warn_fallbacks(support, torch.cuda.get_device_name())
    return support


def cuda_ops() -> Optional[ModuleType]:
    """The CUDA module when it exists and the GPU runs at least one of its kernels."""
    support = device_support()
    if support is None or not support.enabled:
        return None
    return _cuda_module()


def kernel_enabled(op: str) -> bool:
    """Whether `op` runs its CUDA kernel on this machine's GPU."""
    support = device_support()
    return support is not None and op in support.enabled


def use_kernel(op: str, *tensors: torch.Tensor) -> Optional[ModuleType]:
    """The CUDA module if every tensor is on a CUDA device and `op`'s kernel runs there, else None."""
    if op not in KERNEL_MIN_CAPABILITY:
        raise KeyError(f"use_kernel: unknown op {op!r} (known: {sorted(KERNEL_MIN_CAPABILITY)})")
    if not all(t.is_cuda for t in tensors) or not kernel_enabled(op):
        return None
    return _cuda_module()


def clear_cache() -> None:
    """Forget the module and the device check (after TINYVLLM_DISABLE_CUDA_KERNELS changes)."""
    _cuda_module.cache_clear()
    device_support.cache_clear()


def stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream
