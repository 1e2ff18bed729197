"""Linear layers over 8-bit weights and 8-bit activations (W8A8): INT8 or FP8 (e4m3).

Every W8A8 format (compressed-tensors `int-quantized` / `float-quantized`, and a float checkpoint
quantized at load by `--quantization int8|fp8`) is turned at load into this one layout, which the
CUDA path (cuBLAS through `torch._int_mm` / `torch._scaled_mm`), the CPU kernels (int8:
`_cpu.int8_linear`, exact int32 sums) and the torch reference all read:

    qweight       [n, k] int8 or float8_e4m3fn, row-major: its transpose is the column-major
                  [k, n] operand that torch._int_mm and torch._scaled_mm take
    weight_scale  float32 [n]         w[i, :] = qweight[i, :] * weight_scale[i] (a per-tensor
                                      scale is repeated over n at load)
    input_scale   float32 [] or None  a static per-tensor activation scale; None: dynamic, one
                                      scale per token (row of x)

Each row of x is quantized to the weight's type, then

    y = (qx @ qweight.T) * x_scale * weight_scale + bias        (accumulated exactly: int32 / fp32)

    x_scale = max|x_row| / divisor (dynamic) or input_scale (static), an IEEE float32 division
    qx      = int8: x / x_scale clamped to [-128, 127] (the int8 range that compressed-tensors
              calibrates static scales for), rounded half to even
              fp8:  x / x_scale clamped to +-448, cast to float8_e4m3fn (round to nearest even)

The dynamic scale's divisor is the checkpoint's convention (`act_scale_divisor`):

    "qmax"                QMAX: int8 127, fp8 448; max|x| maps to the largest quantized
                          magnitude, as vLLM's kernels scale (`--quantization int8|fp8` at load)
    "compressed-tensors"  COMPRESSED_TENSORS_DIVISOR, (q_max - q_min) / 2 of compressed-tensors'
                          calculate_qparams: int8 (127 + 128) / 2 = 127.5, fp8 (448 + 448) / 2 =
                          448; its int-quantized / float-quantized checkpoints are calibrated and
                          evaluated with it (max|x| maps to 127.5, then clamped to 127)

The rows may come quantized already (`QuantizedRows`): on CUDA the RMSNorm or SwiGLU before a
projection quantizes its output itself (`ops.rms_norm_quant`, `ops.silu_and_mul_quant`, one kernel
each), with the values and scales `quantize_rows` would give, and the projection skips that step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from tinyvllm.ops._dispatch import dtype_code, kernel_config, stream_handle, use_kernel

FP8_DTYPE = torch.float8_e4m3fn
QMAX = {torch.int8: 127.0, FP8_DTYPE: float(torch.finfo(FP8_DTYPE).max)}
"""The largest quantized magnitude per type (fp8 e4m3: 448): the clamp bound, and the divisor of
the "qmax" convention (max|x| maps to it)."""
QMIN = {torch.int8: -128.0, FP8_DTYPE: -float(torch.finfo(FP8_DTYPE).max)}
COMPRESSED_TENSORS_DIVISOR = {dtype: (QMAX[dtype] - QMIN[dtype]) / 2 for dtype in QMAX}
"""compressed-tensors' dynamic scale max|x| / ((q_max - q_min) / 2): int8 127.5, fp8 448."""
ACT_SCALE_DIVISORS = {"qmax": QMAX, "compressed-tensors": COMPRESSED_TENSORS_DIVISOR}
"""A dynamic activation scale convention (`WeightScheme.act_scale`) -> its divisor per type."""
MIN_ABSMAX = 1e-10
"""max|x| of an all-zero row is taken as this, so that its scale is positive (its values stay 0)."""
INT_MM_MIN_ROWS = 17
"""torch._int_mm on CUDA needs more than 16 rows: smaller batches are padded with zero rows."""
INT8_ALIGN, FP8_ALIGN = 8, 16
"""torch._int_mm needs k and n multiples of 8; torch._scaled_mm multiples of 16 (ATen's checks)."""
INT8_MIN_CAPABILITY, FP8_MIN_CAPABILITY = (8, 0), (8, 9)
"""cuBLAS int8 GEMMs run on the project's minimum (sm_80); torch._scaled_mm needs sm_89 or newer."""


class QuantizedRows(NamedTuple):
    """Activations quantized per row by the op that made them (`ops.rms_norm_quant`,
    `ops.silu_and_mul_quant`), for a W8A8 projection to take in place of float rows."""

    q: torch.Tensor
    """[num_tokens, k] int8 or float8_e4m3fn, the weight's type."""
    scales: torch.Tensor
    """[num_tokens, 1] float32: row i is q[i] * scales[i]."""
    dtype: torch.dtype
    """The float dtype of the rows before quantization: the projection's output dtype."""


def check_layout(qweight: torch.Tensor, weight_scale: torch.Tensor,
                 input_scale: Optional[torch.Tensor] = None) -> tuple[int, int]:
    """(n, k) of a weight in the layout above; raises ValueError naming what does not fit."""
    if qweight.dtype not in QMAX or qweight.dim() != 2:
        raise ValueError(f"qweight: expected an int8 or float8_e4m3fn [n, k] tensor, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
        raise ValueError(f"weight_scale: expected a float32 ({n},) tensor, got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    if input_scale is not None and (input_scale.dtype != torch.float32
                                    or input_scale.numel() != 1):
        raise ValueError(f"input_scale: expected a float32 scalar tensor, got "
                         f"{input_scale.dtype} {tuple(input_scale.shape)}")
    return n, k


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor] = None,
                  divisor: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of each row of x to `dtype` (int8 or float8_e4m3fn).

    Args:
        x: [m, k] float.
        scale: a static float32 scalar scale; None: per row, max|row| / divisor.
        divisor: the dynamic scale's divisor (the module docstring's conventions); None:
            QMAX[dtype].
    Returns:
        (q [m, k] in `dtype`, scales float32 [m, 1]) with x ~ q * scales.

    On CUDA one kernel reads x once and writes q and the scales (cuda/quant_act.cuh), with the
    same values as the torch ops below, which are the reference and the CPU path.
    """
    divisor = quant_divisor(dtype, divisor)
    kernel = use_kernel("quantize_rows", x)
    if kernel is not None and x.dim() == 2 and x.stride(-1) == 1:
        return _quantize_rows_cuda(kernel, x, dtype, scale, divisor)
    return quantize_rows_ref(x, dtype, scale, divisor)


def quant_divisor(dtype: torch.dtype, divisor: Optional[float]) -> float:
    """The dynamic scale's divisor (None: QMAX[dtype]), after checking the quantized type and
    it; raises ValueError naming the bad one."""
    if dtype not in QMAX:
        raise ValueError(f"qdtype: expected torch.int8 or torch.float8_e4m3fn, got {dtype}")
    divisor = QMAX[dtype] if divisor is None else float(divisor)
    if not divisor > 0:
        raise ValueError(f"divisor: expected a positive scale divisor, got {divisor}")
    return divisor


def quantize_rows_ref(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor] = None,
                      divisor: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `quantize_rows` (same arguments)."""
    xf = x.float()
    if scale is None:
        absmax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_ABSMAX)
        # Divided by a tensor, not by the Python number: CUDA turns a division by a scalar into
        # a multiplication by its float32 reciprocal, which rounds differently from the IEEE
        # division that the CPU, the kernels and compressed-tensors (whose divisor is a tensor
        # on the activations' device) do.
        divisor = QMAX[dtype] if divisor is None else divisor
        scales = absmax / torch.full_like(absmax, divisor)
    else:
        scales = scale.reshape(1, 1).expand(x.shape[0], 1)
    # int8: an IEEE division per value (compressed-tensors' arithmetic, bit for bit). FP8: times
    # the row's reciprocal scale, each rounded once, as the kernels and vLLM's FP8 kernels
    # compute it (a division per value made the fused SwiGLU quantization compute-bound).
    q = xf / scales if dtype == torch.int8 else xf * torch.reciprocal(scales)
    q = q.clamp(QMIN[dtype], QMAX[dtype])
    if dtype == torch.int8:
        q = torch.round(q)  # half to even
    return q.to(dtype), scales


def _quantize_rows_cuda(kernel, x: torch.Tensor, dtype: torch.dtype,
                        scale: Optional[torch.Tensor], divisor: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q, scales = quantized_output(m, k, dtype, x.device)
    scale = static_scale_arg(scale, x.device)  # held until the launch
    kernel.quantize_rows(out=q.data_ptr(), scales=scales.data_ptr(), x=x.data_ptr(),
                         static_scale=0 if scale is None else scale.data_ptr(), num_tokens=m,
                         k=k, x_stride=x.stride(0), out_stride=k, qmax=QMAX[dtype],
                         scale_divisor=divisor, min_absmax=MIN_ABSMAX, dtype=dtype_code(x.dtype),
                         qdtype=dtype_code(dtype), stream=stream_handle(x.device))
    return q, scales


def quantized_output(num_tokens: int, k: int, qdtype: torch.dtype, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [num_tokens, k] qdtype, scales [num_tokens, 1] float32) for a quantizing kernel to
    fill: fresh, so the rows have the alignment its 8-bit packs need."""
    return (torch.empty(num_tokens, k, dtype=qdtype, device=device),
            torch.empty(num_tokens, 1, dtype=torch.float32, device=device))


def static_scale_arg(scale: Optional[torch.Tensor], device: torch.device
                     ) -> Optional[torch.Tensor]:
    """A static scale as the quantizing kernels read it: one float32 on the device."""
    if scale is None:
        return None
    return scale.to(device=device, dtype=torch.float32).reshape(1).contiguous()


def quantize_weight(weight: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [n, k] -> (qweight [n, k] in `dtype`, weight_scale float32 [n]): one scale
    per output channel, max|w[i, :]| / QMAX (`--quantization int8|fp8` at load)."""
    q, scales = quantize_rows(weight, dtype)
    return q, scales.view(-1)


def dequantize(qweight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The weight [n, k] as float32."""
    check_layout(qweight, weight_scale)
    return qweight.float() * weight_scale.unsqueeze(1)


def w8a8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: Optional[torch.Tensor] = None,
                    bias: Optional[torch.Tensor] = None, *,
                    act_scale_divisor: Optional[float] = None) -> torch.Tensor:
    """The module docstring's arithmetic in float32 torch; [..., k] -> [..., n] in x's dtype.

    The products of 8-bit values are exact in float32 (int8: sums exact while k * 127^2 < 2^24,
    k < 1040; beyond that, and for fp8, equal to the exact sum up to float32 summation order).

    Args:
        act_scale_divisor: the dynamic activation scale's divisor, the checkpoint's convention
            (ACT_SCALE_DIVISORS); None: QMAX of the weight's type.
    """
    n, _ = check_layout(qweight, weight_scale, input_scale)
    rows = _quantized(x, qweight, input_scale, act_scale_divisor)
    return quantized_linear_ref(rows, qweight, weight_scale, bias).view(*x.shape[:-1], n)


def quantized_linear_ref(x: QuantizedRows, qweight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`w8a8_linear_ref` from its quantized rows on: [num_tokens, n] in x.dtype."""
    y = (x.q.float() @ qweight.float().t()) * x.scales * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w8a8_linear(x: Union[torch.Tensor, QuantizedRows], qweight: torch.Tensor,
                weight_scale: torch.Tensor, input_scale: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None, *,
                act_scale_divisor: Optional[float] = None) -> torch.Tensor:
    """`w8a8_linear_ref`, through cuBLAS where it serves the inputs: float16 / bfloat16 x on a
    GPU that runs the type's GEMM (int8: sm_80, fp8: sm_89), k and n multiples of 8 (int8) or
    16 (fp8), and on the C++ CPU kernel for int8. The one entry point of the model's W8A8
    layers; [..., k] -> [..., n] in x's dtype. act_scale_divisor: as in `w8a8_linear_ref`.

    x may be rows quantized already (`QuantizedRows` [num_tokens, k] in the weight's type; ->
    [num_tokens, n]): the GEMM and rescale only, input_scale and act_scale_divisor unused.
    """
    check_layout(qweight, weight_scale, input_scale)
    if isinstance(x, QuantizedRows):
        _check_quantized_rows(x, qweight)
        if cuda_supported(x, qweight):
            return scaled_gemm(x, qweight, weight_scale, None, bias)
        return quantized_linear_ref(x, qweight, weight_scale, bias)
    args = (x, qweight, weight_scale, input_scale, bias)
    if cuda_supported(x, qweight):
        return scaled_gemm(*args, act_scale_divisor=act_scale_divisor)
    if cpu_supported(x, qweight, weight_scale):
        return int8_linear_cpu(*args, act_scale_divisor=act_scale_divisor)
    return w8a8_linear_ref(*args, act_scale_divisor=act_scale_divisor)


def _check_quantized_rows(x: QuantizedRows, qweight: torch.Tensor) -> None:
    num_tokens, k = x.q.shape[0], qweight.shape[1]
    if x.q.dtype != qweight.dtype or tuple(x.q.shape) != (num_tokens, k):
        raise ValueError(f"x: expected rows quantized to {qweight.dtype} [num_tokens, {k}], got "
                         f"{x.q.dtype} {tuple(x.q.shape)}")
    if x.scales.dtype != torch.float32 or tuple(x.scales.shape) != (num_tokens, 1):
        raise ValueError(f"x: expected float32 scales ({num_tokens}, 1), got "
                         f"{x.scales.dtype} {tuple(x.scales.shape)}")


def input_quant_fusable(op: str, x: torch.Tensor, qweight: torch.Tensor,
                        input_scale: Optional[torch.Tensor]) -> bool:
    """Whether `op` (rms_norm_quant or silu_and_mul_quant), the op that makes a W8A8
    projection's input from x, should quantize the rows itself and hand over `QuantizedRows`:
    dynamic activation scales, the fusion on (`KernelConfig.fused_act_quant`), op's CUDA kernel
    serving x and the projection's GEMM on cuBLAS (`cuda_supported`). Elsewhere the projection
    quantizes its float input as before (CPU, static scales, the torch reference on a GPU)."""
    return (input_scale is None and kernel_config().fused_act_quant
            and cuda_supported(x, qweight) and use_kernel(op, x) is not None)


def _quantized(x: Union[torch.Tensor, QuantizedRows], qweight: torch.Tensor,
               input_scale: Optional[torch.Tensor], divisor: Optional[float]) -> QuantizedRows:
    """x's rows quantized to the weight's type ([num_tokens, k]); QuantizedRows as they are."""
    if isinstance(x, QuantizedRows):
        return x
    q, scales = quantize_rows(x.reshape(-1, qweight.shape[1]), qweight.dtype, input_scale,
                              divisor)
    return QuantizedRows(q, scales, x.dtype)


def cpu_supported(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """int8 weights on the CPU with the C++ kernels (tinyvllm._cpu) present."""
    from tinyvllm.ops.quantized import cpu_kernels

    return (x.device.type == "cpu" and qweight.device.type == "cpu" and qweight.dtype == torch.int8
            and qweight.is_contiguous() and weight_scale.is_contiguous()
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and cpu_kernels() is not None)


def int8_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: Optional[torch.Tensor] = None,
                    bias: Optional[torch.Tensor] = None, *,
                    act_scale_divisor: Optional[float] = None,
                    isa: str = "auto") -> torch.Tensor:
    """`w8a8_linear_ref` for int8 weights on the CPU kernels (`_cpu.int8_linear`): the same
    quantized rows and scales, the products summed exactly in int32 (the reference's float32 sums
    are exact while k * 127^2 < 2^24), then the same float32 rescale; [..., k] -> [..., n].

    Args:
        act_scale_divisor: as in `w8a8_linear_ref` (None: 127).
        isa: "auto" (env TINYVLLM_CPU_ISA overrides), "avx512vnni", "avx2" or "scalar".
    """
    from tinyvllm.ops.quantized import cpu_kernels

    n, k = check_layout(qweight, weight_scale, input_scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if bias is not None:
        bias = bias.float().contiguous()
    if input_scale is not None:
        input_scale = input_scale.float().reshape(1).contiguous()
    cpu_kernels().int8_linear(
        out.data_ptr(), x2.data_ptr(), qweight.data_ptr(), weight_scale.data_ptr(),
        0 if input_scale is None else input_scale.data_ptr(),
        QMAX[torch.int8] if act_scale_divisor is None else act_scale_divisor,
        0 if bias is None else bias.data_ptr(), m, n, k, x2.stride(0), n, isa)
    return out.to(x.dtype).view(*lead, n)


def scaled_gemm(x: Union[torch.Tensor, QuantizedRows], qweight: torch.Tensor,
                weight_scale: torch.Tensor, input_scale: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None, *,
                act_scale_divisor: Optional[float] = None) -> torch.Tensor:
    """The GEMM path of `w8a8_linear` (torch._int_mm / torch._scaled_mm; torch's CPU kernels
    run it too, which tests use), for the inputs `cuda_supported` admits; x float [..., k], or
    `QuantizedRows` [num_tokens, k] (not quantized again)."""
    n = qweight.shape[0]
    lead = (x.q if isinstance(x, QuantizedRows) else x).shape[:-1]
    rows = _quantized(x, qweight, input_scale, act_scale_divisor)
    if bias is not None:
        bias = bias.to(rows.dtype)
    if qweight.dtype == torch.int8:
        y = _int8_gemm(rows.q, qweight, rows.scales, weight_scale, bias, rows.dtype)
    else:
        # Row-wise scaling: scale_a float32 [m, 1] and scale_b [1, n], both contiguous; the
        # bias (in the output dtype, as torch._scaled_mm requires) is added before rounding.
        y = torch._scaled_mm(rows.q, qweight.t(), scale_a=rows.scales.contiguous(),
                             scale_b=weight_scale.view(1, n), bias=bias, out_dtype=rows.dtype,
                             use_fast_accum=kernel_config().fp8_fast_accum)
    return y.view(*lead, n)


def _int8_gemm(qx: torch.Tensor, qweight: torch.Tensor, x_scale: torch.Tensor,
               weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
               dtype: torch.dtype) -> torch.Tensor:
    """qx int8 [m, k] @ qweight.T through torch._int_mm (int32), rescaled (and the bias added)
    in float32, rounded once to `dtype`; [m, n]."""
    m = qx.shape[0]
    if m < INT_MM_MIN_ROWS:
        qx = F.pad(qx, (0, 0, 0, INT_MM_MIN_ROWS - m))
    acc = torch._int_mm(qx, qweight.t())[:m]  # [m, n] int32
    kernel = use_kernel("quantize_rows", acc)
    if kernel is not None:  # the lines below in one pass over acc
        return _rescale_int32_cuda(kernel, acc, x_scale, weight_scale, bias, dtype)
    y = acc.float() * x_scale * weight_scale
    return (y if bias is None else y + bias.float()).to(dtype)


def _rescale_int32_cuda(kernel, acc: torch.Tensor, x_scale: torch.Tensor,
                        weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
                        dtype: torch.dtype) -> torch.Tensor:
    m, n = acc.shape
    out = torch.empty(m, n, dtype=dtype, device=acc.device)
    # held in locals: a temporary's memory could be handed to the next one before the launch
    xs, ws = x_scale.contiguous(), weight_scale.contiguous()
    b = None if bias is None else bias.contiguous()
    kernel.rescale_int32(out=out.data_ptr(), acc=acc.data_ptr(), x_scale=xs.data_ptr(),
                         w_scale=ws.data_ptr(), bias=0 if b is None else b.data_ptr(), m=m, n=n,
                         acc_stride=acc.stride(0), out_stride=n, dtype=dtype_code(dtype),
                         stream=stream_handle(acc.device))
    return out


def cuda_supported(x: Union[torch.Tensor, QuantizedRows], qweight: torch.Tensor) -> bool:
    """Whether the cuBLAS path serves these inputs (else the torch reference runs)."""
    device = x.q.device if isinstance(x, QuantizedRows) else x.device
    if device.type != "cuda" or not qweight.is_cuda:
        return False
    if x.dtype not in (torch.float16, torch.bfloat16):
        return False
    n, k = qweight.shape
    int8 = qweight.dtype == torch.int8
    align = INT8_ALIGN if int8 else FP8_ALIGN
    need = INT8_MIN_CAPABILITY if int8 else FP8_MIN_CAPABILITY
    return n % align == 0 and k % align == 0 and _capability(device) >= need


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)
