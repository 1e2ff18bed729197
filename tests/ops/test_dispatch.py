"""Which CUDA kernels run on which GPU: the compute-capability check of ops/_dispatch.py, the
refusal of a stale or partial module, and the engine's kernel choices.

The GPU is mocked here (capability, name, and a module that says which architectures it was
built for); tests/gpu/test_device_support_gpu.py checks the real one.
"""

from __future__ import annotations

import enum
import logging
import sys
import types

import pytest
import torch

from tinyvllm import ops
from tinyvllm.config import KernelConfig
from tinyvllm.ops import _dispatch
from tinyvllm.ops._dispatch import (CUDA_ABI_VERSION, KERNEL_FUNCTIONS, KERNEL_MIN_CAPABILITY,
                                    CudaModuleError, image_runs_on, kernel_support,
                                    module_archs, module_problem)

DEFAULT_ARCHS = ["80", "89-real", "90a-real"]  # CMakeLists.txt's default


@pytest.mark.parametrize("arch,capability,runs", [
    ("80", (8, 0), True),         # SASS, same version
    ("80", (8, 6), True),         # SASS runs on a newer minor of the same major
    ("80", (12, 0), True),        # PTX, compiled by the driver for a newer GPU
    ("80-real", (9, 0), False),   # SASS only: no other major
    ("80", (7, 5), False),        # older GPU
    ("89-real", (8, 6), False),   # SASS never runs on an older minor
    ("89-real", (8, 9), True),
    ("90a-real", (9, 0), True),
    ("90a", (10, 0), False),      # architecture-specific code, PTX included, runs on 9.0 only
    ("80-virtual", (8, 9), True),
])
def test_image_runs_on(arch, capability, runs):
    assert image_runs_on(arch, capability) is runs


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_default_build_runs_every_kernel_from_ampere_on(capability):
    support = kernel_support(capability, DEFAULT_ARCHS)
    assert support.enabled == frozenset(KERNEL_MIN_CAPABILITY) and support.disabled == {}


def test_older_gpu_falls_back_for_every_kernel_with_the_reason():
    support = kernel_support((7, 5), DEFAULT_ARCHS)
    assert support.enabled == frozenset()
    assert set(support.disabled) == set(KERNEL_MIN_CAPABILITY)
    assert support.disabled["paged_attention"] == (
        "the module was compiled for 80;89-real;90a-real, nothing that runs on 7.5")


def test_a_build_for_hopper_only_falls_back_on_ampere():
    support = kernel_support((8, 0), ["90a"])
    assert support.enabled == frozenset() and "90a" in support.disabled["rms_norm"]


def test_per_kernel_minimum():
    table = {"rms_norm": (8, 0), "fp8_gemm": (8, 9), "wgmma_gemm": (9, 0)}
    support = kernel_support((8, 9), None, table)
    assert support.enabled == {"rms_norm", "fp8_gemm"}
    assert support.disabled == {"wgmma_gemm": "needs compute capability 9.0, the device has 8.9"}


def test_module_archs():
    assert module_archs(types.SimpleNamespace(cuda_archs="80,89-real,90a-real")) == DEFAULT_ARCHS
    assert module_archs(types.SimpleNamespace()) is None  # built before it said: not checked
    assert module_archs(types.SimpleNamespace(cuda_archs="native")) is None  # CMake resolved it


@pytest.fixture
def mocked_gpu(monkeypatch):
    """A GPU of the given capability with a module built for the default architectures."""
    module = types.ModuleType("tinyvllm._cuda")
    module.cuda_archs = ",".join(DEFAULT_ARCHS)

    def install(capability: tuple[int, int], name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
        monkeypatch.setattr(_dispatch, "_cuda_module", lambda: module)
        _dispatch.device_support.cache_clear()

    yield install
    monkeypatch.undo()
    _dispatch.clear_cache()


def test_unsupported_gpu_warns_once_naming_the_kernels(mocked_gpu, caplog):
    mocked_gpu((7, 5), "Tesla T4")
    with caplog.at_level(logging.WARNING, logger="tinyvllm.ops._dispatch"):
        assert _dispatch.cuda_ops() is None
        assert not _dispatch.kernel_enabled("paged_attention")
        assert _dispatch.cuda_ops() is None  # checked once: no second warning
    (record,) = caplog.records
    message = record.getMessage()
    assert "Tesla T4 (compute capability 7.5)" in message
    for op in KERNEL_MIN_CAPABILITY:
        assert op in message
    assert "torch reference" in message


def test_supported_gpu_enables_every_kernel_silently(mocked_gpu, caplog):
    mocked_gpu((8, 9), "NVIDIA L4")
    with caplog.at_level(logging.WARNING, logger="tinyvllm.ops._dispatch"):
        assert _dispatch.cuda_ops() is not None
        assert all(_dispatch.kernel_enabled(op) for op in KERNEL_MIN_CAPABILITY)
    assert caplog.records == []
    # tensors off the GPU never take a kernel, whatever the GPU supports
    assert _dispatch.use_kernel("rms_norm", torch.ones(2)) is None


def test_unknown_op_is_an_error():
    with pytest.raises(KeyError, match="unknown op 'rms_nrom'"):
        _dispatch.use_kernel("rms_nrom", torch.ones(2))


# ---- a stale or partial build is refused on a GPU ----------------------------------------------

LAUNCHERS = sorted({f for functions in KERNEL_FUNCTIONS.values() for f in functions})


def built_module(abi_version: int = CUDA_ABI_VERSION, without: tuple[str, ...] = ()):
    """A module shaped like tinyvllm._cuda; each launcher returns its positional arguments."""
    module = types.ModuleType("tinyvllm._cuda")
    module.abi_version = abi_version
    module.cuda_archs = ",".join(DEFAULT_ARCHS)
    module.DType = enum.IntEnum("DType", {"float32": 0, "float16": 1, "bfloat16": 2})
    module.arg_names = {}
    for name in LAUNCHERS:
        if name not in without:
            setattr(module, name, lambda *args: args)
            module.arg_names[name] = ("out", "x", "stream")
    if "DType" in without:
        del module.DType
    return module


@pytest.fixture
def machine(monkeypatch):
    """machine(cuda=..., module=...): whether torch sees a CUDA device, and what importing
    tinyvllm._cuda gives (None: the import fails)."""
    monkeypatch.delenv("TINYVLLM_DISABLE_CUDA_KERNELS", raising=False)

    def install(cuda: bool, module) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")
        monkeypatch.setitem(sys.modules, "tinyvllm._cuda", module)
        _dispatch.clear_cache()

    yield install
    monkeypatch.undo()
    _dispatch.clear_cache()


def test_every_op_names_the_launchers_it_calls():
    assert set(KERNEL_FUNCTIONS) == set(KERNEL_MIN_CAPABILITY)


def test_module_problem_names_what_does_not_match():
    assert module_problem(built_module()) is None
    assert module_problem(built_module(abi_version=CUDA_ABI_VERSION - 1)) == (
        f"it reports ABI version {CUDA_ABI_VERSION - 1}, this package calls version "
        f"{CUDA_ABI_VERSION}")
    assert module_problem(built_module(without=("gemv_merge", "DType"))) == (
        "it lacks gemv_merge, DType")
    old = built_module()
    del old.abi_version  # built before modules said
    assert "ABI version None" in module_problem(old)


@pytest.mark.parametrize("module,problem", [
    (built_module(abi_version=0), "ABI version 0"),
    (built_module(without=("rejection_sample",)), "lacks rejection_sample"),
    (None, "could not be imported"),
])
def test_a_gpu_with_a_stale_missing_or_partial_module_is_refused(machine, module, problem):
    machine(cuda=True, module=module)
    for check in (_dispatch.device_support, _dispatch.cuda_ops):  # what the engine asks at start
        with pytest.raises(CudaModuleError, match=problem) as error:
            check()
        assert "TINYVLLM_CUDA=ON pip install -e ." in str(error.value)
    with pytest.raises(CudaModuleError):  # an op on CUDA tensors never runs the reference
        _dispatch.use_kernel("rms_norm", FakeCudaTensor())


class FakeCudaTensor:
    is_cuda = True


def test_without_a_gpu_the_references_run_whatever_the_module(machine):
    for module in (built_module(abi_version=0), None):
        machine(cuda=False, module=module)
        assert _dispatch.device_support() is None and _dispatch.cuda_ops() is None
        assert _dispatch.use_kernel("rms_norm", FakeCudaTensor()) is None
        x, w = torch.ones(2, 8), torch.full((8,), 2.0)
        assert torch.equal(ops.rms_norm(x, w, 0.0), torch.full((2, 8), 2.0))


def test_disabled_kernels_ignore_the_module(machine, monkeypatch):
    machine(cuda=True, module=None)
    monkeypatch.setenv("TINYVLLM_DISABLE_CUDA_KERNELS", "1")
    _dispatch.clear_cache()
    assert _dispatch.cuda_ops() is None


def test_a_matching_module_is_called_by_keyword(machine):
    machine(cuda=True, module=built_module())
    kernels = _dispatch.cuda_ops()
    assert kernels.rms_norm(out=1, x=2, stream=3) == (1, 2, 3)  # positional into the binding
    with pytest.raises(TypeError, match="unexpected keyword argument 'residual'"):
        kernels.rms_norm(out=1, x=2, stream=3, residual=4)
    with pytest.raises(TypeError, match="positional"):
        kernels.rms_norm(1, 2, 3)
    assert _dispatch.dtype_code(torch.bfloat16) == 2  # the module's table, not one of our own
    with pytest.raises(ValueError, match="the CUDA kernels take .*got torch.float64"):
        _dispatch.dtype_code(torch.float64)


# ---- the engine's kernel choices ---------------------------------------------------------------

def test_configure_installs_the_kernel_choices():
    assert ops.kernel_config() == KernelConfig()
    try:
        ops.configure(KernelConfig(fused_gemv=False, gemv_max_rows=1))
        assert ops.kernel_config() == KernelConfig(fused_gemv=False, gemv_max_rows=1)
    finally:
        ops.configure(KernelConfig())
