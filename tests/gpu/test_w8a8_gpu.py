"""W8A8 models on CUDA end to end: the projections' inputs quantized by the RMSNorm and SwiGLU
before them (`ops.rms_norm_quant`, `ops.silu_and_mul_quant`) give the logits of the separate
quantize_rows launches (KernelConfig(fused_act_quant=False)), bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_fp8_kv_cache_gpu import run_steps
from tinyvllm import ops
from tinyvllm.config import KernelConfig
from tinyvllm.model.quantization.layer import W8A8Linear
from tinyvllm.model.synthetic import SMOLLM2_135M_SHAPE, make_random_quantized_model
from tinyvllm.ops import w8a8_linear as w8

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_fused_input_quantization_keeps_the_logits(method, dtype):
    """Prefills, a chunked prefill beside decodes and batched decodes (`run_steps`) of the
    smollm2-135m-shape model with W8A8 projections: the same logits with the fusion on and off,
    and on means every projection's input comes quantized."""
    need = w8.INT8_MIN_CAPABILITY if method == "int8" else w8.FP8_MIN_CAPABILITY
    if torch.cuda.get_device_capability() < need:
        pytest.skip(f"{method} GEMMs need compute capability {need}")
    model = make_random_quantized_model(SMOLLM2_135M_SHAPE, 0, dtype, torch.device("cuda"),
                                        method)
    layer = model.model.layers[0]
    x = torch.zeros(3, SMOLLM2_135M_SHAPE.hidden_size, dtype=dtype, device="cuda")
    for proj, op in ((layer.self_attn.qkv_proj, "rms_norm_quant"),
                     (layer.mlp.gate_up_proj, "rms_norm_quant"),
                     (layer.mlp.down_proj, "silu_and_mul_quant")):
        assert isinstance(proj, W8A8Linear) and proj.fused_input_quant(op, x) is not None
    fused = run_steps(model, dtype)
    try:
        ops.configure(KernelConfig(fused_act_quant=False))
        assert layer.mlp.down_proj.fused_input_quant("silu_and_mul_quant", x) is None
        unfused = run_steps(model, dtype)
    finally:
        ops.configure(KernelConfig())
    assert bool(torch.isfinite(fused).all())
    assert torch.equal(fused, unfused)
