"""Which CUDA kernels run on which GPU: the compute-capability check of ops/_dispatch.py.

The GPU is mocked here (capability, name, and a module that says which architectures it was
built for); tests/gpu/test_device_support_gpu.py checks the real one.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from tinyvllm.ops import _dispatch
from tinyvllm.ops._dispatch import (KERNEL_MIN_CAPABILITY, image_runs_on, kernel_support,
                                    module_archs)

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
