"""Finding the CUDA module, which of its kernels the GPU can run, and which the engine chose.

`cuda_ops()` is None when no GPU exists (or TINYVLLM_DISABLE_CUDA_KERNELS=1), or the GPU runs none
of the kernels. With a GPU, the module is checked once, at the first call (the model runner makes
it at start): a module that is missing, or was built from other sources than this Python package
(its `abi_version` or functions differ), raises `CudaModuleError` instead of silently running the
torch references. Then each op asks `use_kernel(op, ...)`: the device's compute capability is
checked once, and every op the GPU cannot run is named in one warning and falls back to its torch
reference.

`configure(KernelConfig)` installs the engine's choice of fusions (`kernel_config()`); the ops
and the model's decode path read it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import keyword
import logging
import os
import re
from types import ModuleType
from typing import Optional, Sequence

import torch

from tinyvllm.config import KernelConfig

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
    "quant_linear": (8, 0),
    "gguf_linear": (8, 0),
    "quantize_rows": (8, 0),
    "rms_norm_quant": (8, 0),
    "silu_and_mul_quant": (8, 0),
}

KERNEL_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "paged_attention": ("paged_attention", "paged_attention_decode", "paged_decode_merge"),
    "reshape_and_cache": ("reshape_and_cache",),
    "rms_norm": ("rms_norm",),
    "silu_and_mul": ("silu_and_mul",),
    "rotary_embedding": ("rotary_embedding",),
    "rotary_embedding_and_cache": ("rotary_embedding_and_cache",),
    "fused_linear": ("gemv", "gemv_merge"),
    "sample": ("sample",),
    "rejection_sample": ("rejection_sample",),
    "quant_linear": ("quant_gemv", "quant_dequantize", "quant_tile_gemv", "quant_tile_rows",
                     "quant_tile_dequantize"),
    "gguf_linear": ("gguf_gemv", "gguf_dequantize"),
    "quantize_rows": ("quantize_rows", "rescale_int32"),
    "rms_norm_quant": ("rms_norm_quant",),
    "silu_and_mul_quant": ("silu_and_mul_quant",),
}
"""Op -> the module's functions its CUDA path calls (same keys as KERNEL_MIN_CAPABILITY)."""

CUDA_ABI_VERSION = 13
"""The launcher interface this package calls; a module must report it as its `abi_version`
(cuda/launchers.h kAbiVersion: the two are bumped together)."""

REBUILD_HINT = ("rebuild it: `TINYVLLM_CUDA=ON pip install -e .` in a checkout (`pip install .` "
                "otherwise), or set TINYVLLM_DISABLE_CUDA_KERNELS=1 to run the torch references "
                "on the GPU")


class CudaModuleError(RuntimeError):
    """A CUDA device is present but tinyvllm._cuda is missing or does not match this package."""


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


def module_problem(module: ModuleType) -> Optional[str]:
    """Why `module` cannot serve this package's ops (None when it can): another ABI version than
    CUDA_ABI_VERSION (a stale or newer build), or a launcher or the DType codes missing."""
    version = getattr(module, "abi_version", None)
    if version != CUDA_ABI_VERSION:
        return (f"it reports ABI version {version}, this package calls version "
                f"{CUDA_ABI_VERSION}")
    arg_names = getattr(module, "arg_names", {})
    wanted = sorted({f for functions in KERNEL_FUNCTIONS.values() for f in functions})
    missing = [f for f in wanted if f not in arg_names or not hasattr(module, f)]
    missing += [] if hasattr(module, "DType") else ["DType"]
    return f"it lacks {', '.join(missing)}" if missing else None


def keyword_module(module: ModuleType) -> ModuleType:
    """The CUDA module as the ops call it: its attributes, with each launcher named in
    `module.arg_names` (name -> argument names) replaced by a keyword-only function that calls
    it positionally. Python checks the names (a wrong or missing one raises TypeError), and the
    call costs about what a positional one does, where pybind11's own keyword matching would add
    microseconds to every launch."""
    facade = ModuleType(module.__name__, module.__doc__)
    facade.__dict__.update((k, v) for k, v in vars(module).items() if not k.startswith("__"))
    facade.__file__ = getattr(module, "__file__", None)
    for name, params in module.arg_names.items():
        setattr(facade, name, _keyword_only(name, getattr(module, name), tuple(params)))
    return facade


def _keyword_only(name: str, launcher, params: tuple[str, ...]):
    """`launcher(p0, p1, ...)` as `name(*, p0, p1, ...)`, compiled once (as namedtuple builds
    its classes) so that the call adds no Python-level argument handling of its own."""
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in (name, *params)):
        raise ValueError(f"{name}: argument names {params} are not all Python identifiers")
    names = ", ".join(params)
    namespace = {"_launcher": launcher}
    exec(f"def {name}(*, {names}):\n    return _launcher({names})\n", namespace)
    function = namespace[name]
    function.__doc__ = launcher.__doc__
    return function


@functools.cache
def _cuda_module() -> Optional[ModuleType]:
    """The checked CUDA module (as `keyword_module` wraps it); None where the torch references
    run by design (no CUDA device, or TINYVLLM_DISABLE_CUDA_KERNELS=1).

    Raises:
        CudaModuleError: a CUDA device, but a module that does not import or does not match.
    """
    if os.environ.get("TINYVLLM_DISABLE_CUDA_KERNELS") == "1" or not torch.cuda.is_available():
        return None
    try:
        module = importlib.import_module("tinyvllm._cuda")
    except ImportError as e:
        raise CudaModuleError(f"tinyvllm._cuda could not be imported ({e}) although a CUDA "
                              f"device is present; {REBUILD_HINT}") from e
    problem = module_problem(module)
    if problem is not None:
        raise CudaModuleError(f"tinyvllm._cuda ({getattr(module, '__file__', '?')}) was built "
                              f"from other sources than this package: {problem}; {REBUILD_HINT}")
    return keyword_module(module)


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
    _dtype_codes.cache_clear()
    runs_sm90a_code.cache_clear()


def dtype_code(dtype: torch.dtype) -> int:
    """The code of `dtype` in the launchers' `dtype` / `cache_dtype` arguments, as the module
    defines it (`_cuda.DType`, named as torch's dtypes: cuda/dtype.h is the one table).

    Raises:
        ValueError: a dtype the module has no code for.
    """
    codes = _dtype_codes(_cuda_module())
    if dtype not in codes:
        raise ValueError(f"dtype: the CUDA kernels take {', '.join(map(str, codes))}, got {dtype}")
    return codes[dtype]


@functools.cache
def _dtype_codes(module: ModuleType) -> dict[torch.dtype, int]:
    return {getattr(torch, name): int(code) for name, code in module.DType.__members__.items()}


_kernel_config = KernelConfig()


def configure(config: KernelConfig) -> None:
    """Install the engine's kernel choices for this process (once, where the model runner
    starts; later calls replace them). Until then the defaults (`KernelConfig()`) hold."""
    global _kernel_config
    _kernel_config = config


def kernel_config() -> KernelConfig:
    """The kernel choices in force (see `configure`)."""
    return _kernel_config


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def runs_sm90a_code(device: torch.device) -> bool:
    """Whether the module's sm_90a image runs on the device (compute capability 9.0 and a build
    for 90a): the Hopper-only kernels (wgmma prefill attention, the W4A16 wgmma GEMM)."""
    module = cuda_ops()
    archs = module_archs(module) if module is not None else None
    return (device.type == "cuda" and archs is not None and any(a.startswith("90a") for a in archs)
            and torch.cuda.get_device_capability(device) == (9, 0))


def stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream
