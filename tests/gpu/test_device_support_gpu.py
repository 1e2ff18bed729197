"""The compute-capability check on the real GPU: the module says what it was built for, and on
the GPUs the default build targets (A100, L4/L40, H100/H200) every kernel runs."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops import _dispatch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_device_support_matches_the_device():
    support = _dispatch.device_support()
    assert support is not None, "tinyvllm._cuda not built"
    capability = torch.cuda.get_device_capability()
    assert support.capability == capability
    archs = _dispatch.module_archs(_dispatch._cuda_module())
    assert archs, "the module does not report its architectures (rebuild it)"
    runs = any(_dispatch.image_runs_on(a, capability) for a in archs)
    if capability >= (8, 0) and runs:
        assert support.enabled == frozenset(_dispatch.KERNEL_MIN_CAPABILITY)
    else:
        assert not support.enabled


def test_kernel_runs_and_matches_reference():
    if not _dispatch.kernel_enabled("rms_norm"):
        pytest.skip("rms_norm kernel does not run on this GPU")
    from tinyvllm.ops.layers import rms_norm, rms_norm_ref

    x = torch.randn(5, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
