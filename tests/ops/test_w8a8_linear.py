"""ops/w8a8_linear.py on the CPU: the activation quantization (rounding, clamping, zero rows,
static scales), the reference's arithmetic against exact integer products, layout errors, and
the C++ int8 kernel (every instruction set this machine runs) against the reference; rows
quantized by the op before the projection (ops.rms_norm_quant, ops.silu_and_mul_quant: their
references, and a projection taking them)."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops import quantized as q
from tinyvllm.ops import w8a8_linear as w8
from tinyvllm.ops.layers import (rms_norm_quant, rms_norm_quant_ref, rms_norm_ref,
                                 silu_and_mul_quant, silu_and_mul_quant_ref, silu_and_mul_ref)

FP8 = torch.float8_e4m3fn


def test_int8_rounds_half_to_even_and_clamps_to_the_int8_range():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 200.0, -200.0, 0.0]])
    q, scale = w8.quantize_rows(x, torch.int8, torch.tensor(1.0))
    assert q.dtype == torch.int8 and scale.shape == (1, 1)
    assert q.tolist() == [[0, 2, 2, 0, -2, 126, 127, -128, 0]]


def test_dynamic_scales_map_each_rows_absmax_to_qmax():
    x = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 10.0, 300.0, 1.0, 2.0])[:, None]
    x[4] = 0
    for dtype, qmax in ((torch.int8, 127), (FP8, 448)):
        q, scale = w8.quantize_rows(x, dtype)
        assert scale.shape == (6, 1) and bool((scale > 0).all())
        amax = q.float().abs().amax(1)
        assert amax[[0, 1, 2, 3, 5]].tolist() == [qmax] * 5
        assert amax[4].item() == 0  # an all-zero row: zeros, no NaN
        torch.testing.assert_close(scale[[0, 1, 2, 3, 5], 0],
                                   x[[0, 1, 2, 3, 5]].abs().amax(1) / qmax)


def test_compressed_tensors_divisor_is_half_the_quantized_range():
    """(q_max - q_min) / 2: int8 (127 + 128) / 2, fp8 e4m3 (448 + 448) / 2."""
    assert w8.COMPRESSED_TENSORS_DIVISOR == {torch.int8: 127.5, FP8: 448.0}
    assert w8.ACT_SCALE_DIVISORS["qmax"] == {torch.int8: 127.0, FP8: 448.0}


@pytest.mark.parametrize("divisor", [127.0, 127.5, 100.25])
def test_dynamic_scale_is_an_ieee_division_by_the_divisor(divisor):
    """scale = float32(max|x_row| / divisor), the correctly rounded quotient (checked against
    float64), not max|x| times a rounded reciprocal; the row's largest value then lands on
    +-divisor up to the scale's rounding, clamped to 127: with 127.5, 127 for a positive maximum
    and -128 (half to even) or -127 (just under the tie) for a negative one."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2000, 24, generator=gen) * torch.logspace(-3, 3, 2000)[:, None]
    sign = torch.tensor([1.0, -1.0]).repeat(1000)
    x[:, 5] = sign * x.abs().amax(1) * 1.5  # the row's maximum: positive, then negative
    q, scale = w8.quantize_rows(x, torch.int8, divisor=divisor)
    absmax = x.abs().amax(1, keepdim=True)
    assert torch.equal(scale, (absmax.double() / divisor).float())
    top = q.gather(1, x.abs().argmax(1, keepdim=True)).squeeze(1)
    positive, negative = {127.0: ([127], [-127]), 127.5: ([127], [-128, -127]),
                          100.25: ([100], [-100])}[divisor]
    assert top[0::2].unique().tolist() == positive
    assert top[1::2].unique().tolist() == negative
    assert torch.equal(q.float(), torch.round((x / scale).clamp(-128, 127)))


def test_bad_divisor_is_named():
    with pytest.raises(ValueError, match="divisor: expected a positive scale divisor, got 0.0"):
        w8.quantize_rows(torch.randn(2, 8), torch.int8, divisor=0.0)


def test_fp8_clamps_to_448_instead_of_overflowing():
    x = torch.tensor([[1000.0, -1000.0, 448.0, 0.3]])
    q, _ = w8.quantize_rows(x, FP8, torch.tensor(1.0))
    assert q.float().tolist() == [[448.0, -448.0, 448.0, 0.3125]]  # 0.3: nearest e4m3 value


@pytest.mark.parametrize("static", [False, True])
def test_int8_reference_equals_exact_integer_products(static):
    """k = 1000: every float32 partial sum of int8 products is an exact integer (< 2^24)."""
    gen = torch.Generator().manual_seed(0)
    m, n, k = 9, 24, 1000
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.02
    qweight, weight_scale = w8.quantize_weight(w, torch.int8)
    input_scale = torch.tensor(2.5 / 127) if static else None
    qx, sx = w8.quantize_rows(x, torch.int8, input_scale)
    exact = torch._int_mm(qx, qweight.t().contiguous()).double()  # int32, exact
    bias = torch.randn(n, generator=gen)
    want = exact * sx.double() * weight_scale.double() + bias.double()
    got = w8.w8a8_linear(x, qweight, weight_scale, input_scale, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_leading_dims_dtype_and_the_dequantized_weight():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen) * 0.05
    for dtype in (torch.int8, FP8):
        qweight, weight_scale = w8.quantize_weight(w, dtype)
        assert qweight.dtype == dtype and weight_scale.dtype == torch.float32
        deq = w8.dequantize(qweight, weight_scale)
        assert ((deq - w).norm() / w.norm()).item() < (0.01 if dtype == torch.int8 else 0.04)
        x = torch.randn(2, 3, 64, generator=gen, dtype=torch.bfloat16)
        out = w8.w8a8_linear(x, qweight, weight_scale)
        assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
        ref = x.float() @ w.t()
        assert ((out.float() - ref).norm() / ref.norm()).item() < 0.06


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(4, 8, dtype=torch.int16), torch.ones(4)),
     r"qweight: expected an int8 or float8_e4m3fn \[n, k\] tensor, got torch\.int16"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1)),
     r"weight_scale: expected a float32 \(4,\) tensor, got torch\.float32 \(4, 1\)"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, dtype=torch.bfloat16)),
     r"weight_scale: expected a float32 \(4,\) tensor, got torch\.bfloat16"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), torch.ones(2)),
     r"input_scale: expected a float32 scalar tensor, got torch\.float32 \(2,\)"),
], ids=["qweight-dtype", "scale-shape", "scale-dtype", "input-scale"])
def test_bad_layouts_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        w8.w8a8_linear(torch.randn(2, 8), *args)


@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_gemm_path_on_torchs_cpu_kernels(dtype, m):
    """The CUDA path's calls (torch._int_mm with padding to 17 rows, torch._scaled_mm with
    row-wise float32 scales [m, 1] and [1, n]) run on torch's CPU kernels too: same values as
    the reference, up to the bfloat16 output's rounding (2^-8 relative) and fp32 summation."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
    qweight, weight_scale = w8.quantize_weight(torch.randn(48, 64, generator=gen), dtype)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    for input_scale in (None, torch.tensor(0.01)):
        got = w8.scaled_gemm(x, qweight, weight_scale, input_scale, bias)
        want = w8.w8a8_linear_ref(x.float(), qweight, weight_scale, input_scale, bias.float())
        assert got.shape == (m, 48) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3)


CPU_ISAS = ["scalar"] + [isa for isa in ("avx2", "avx512vnni") if q.isa_available(isa)]


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("divisor", [None, 127.5], ids=["qmax", "compressed-tensors"])
@pytest.mark.parametrize("m,n,k", [(1, 24, 64), (3, 37, 100), (8, 16, 576), (9, 5, 33),
                                   (17, 130, 1000), (40, 9, 200)])
def test_cpu_int8_kernel_equals_the_reference(isa, divisor, m, n, k):
    """`_cpu.int8_linear` quantizes the rows as the reference does and sums the products
    exactly: the same float32 bits while k * 127^2 < 2^24 (the reference's sums exact too), on
    awkward m, n and k (tails of the 64- and 16-value steps), dynamic scales of either
    convention (max|x| / 127 or / 127.5; a negative row maximum then rounds to -128) and static
    ones (clamping some values to -128), with and without a bias."""
    pytest.importorskip("tinyvllm._cpu")
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, :3] = torch.tensor([0.0, -100.0, 2.5])
    qweight, weight_scale = w8.quantize_weight(torch.randn(n, k, generator=gen), torch.int8)
    qweight[0, 0] = -128  # the full int8 range on the weight side too
    bias = torch.randn(n, generator=gen)
    for input_scale in (None, torch.tensor(0.05)):
        for b in (None, bias):
            args = (x, qweight, weight_scale, input_scale, b)
            want = w8.w8a8_linear_ref(*args, act_scale_divisor=divisor)
            got = w8.int8_linear_cpu(*args, act_scale_divisor=divisor, isa=isa)
            assert torch.equal(got, want)
    assert w8.cpu_supported(x, qweight, weight_scale)


def test_cpu_int8_kernel_follows_the_divisor():
    """The divisor reaches the kernel: / 127.5 gives other bits than / 127, and the reference's
    for each; a divisor that is not positive is refused by the kernel itself."""
    pytest.importorskip("tinyvllm._cpu")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(16, 256, generator=gen)
    qweight, weight_scale = w8.quantize_weight(torch.randn(32, 256, generator=gen), torch.int8)
    outs = {}
    for divisor in (127.0, 127.5):
        outs[divisor] = w8.int8_linear_cpu(x, qweight, weight_scale, act_scale_divisor=divisor)
        assert torch.equal(outs[divisor], w8.w8a8_linear_ref(x, qweight, weight_scale,
                                                             act_scale_divisor=divisor))
    assert not torch.equal(outs[127.0], outs[127.5])
    assert torch.equal(w8.w8a8_linear(x, qweight, weight_scale, act_scale_divisor=127.5),
                       outs[127.5])
    out = torch.empty(16, 32)
    with pytest.raises(ValueError, match="scale_divisor must be positive and finite"):
        q.cpu_kernels().int8_linear(out.data_ptr(), x.data_ptr(), qweight.data_ptr(),
                                    weight_scale.data_ptr(), 0, -1.0, 0, 16, 32, 256, 256, 32)


def test_cpu_int8_kernel_past_exact_float_sums():
    """k = 4096: the kernel's int32 sums are exact, the reference's float32 ones round in
    their own order; they agree to float32 summation error."""
    pytest.importorskip("tinyvllm._cpu")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 4096, generator=gen).to(torch.bfloat16)
    qweight, weight_scale = w8.quantize_weight(torch.randn(20, 4096, generator=gen), torch.int8)
    got = w8.w8a8_linear(x, qweight, weight_scale)
    assert got.dtype == torch.bfloat16 and got.shape == (6, 20)
    want = w8.w8a8_linear_ref(x, qweight, weight_scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


# --- rows quantized by the op before the projection -----------------------------------------------

def assert_same_rows(rows: w8.QuantizedRows, q: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> None:
    assert rows.dtype == dtype and rows.q.dtype == q.dtype and rows.q.shape == q.shape
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows.scales, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qdtype,divisor", [(torch.int8, None), (torch.int8, 127.5), (FP8, 448.0)],
                         ids=["int8-127", "int8-127.5", "fp8-448"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fused_references_are_the_composition_of_the_references(dtype, qdtype, divisor, static):
    """rms_norm_quant (with and without the residual add) and silu_and_mul_quant on the CPU: the
    references of rms_norm / silu_and_mul, then quantize_rows', bit for bit; an all-zero row
    quantizes to zeros."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    residual = (torch.randn(7, 96, generator=gen)).to(dtype)
    weight = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    x[2], residual[2] = 0, 0
    scale = torch.tensor(0.02) if static else None
    for op in (rms_norm_quant, rms_norm_quant_ref):
        rows, new_residual = op(x, weight, 1e-5, residual, qdtype, divisor, scale)
        normed, want_residual = rms_norm_ref(x, weight, 1e-5, residual)
        assert_same_rows(rows, *w8.quantize_rows_ref(normed, qdtype, scale, divisor), dtype)
        assert torch.equal(new_residual, want_residual)
        assert not bool(rows.q[2].float().any())
        rows = op(x, weight, 1e-5, None, qdtype, divisor, scale)
        normed = rms_norm_ref(x, weight, 1e-5)
        assert_same_rows(rows, *w8.quantize_rows_ref(normed, qdtype, scale, divisor), dtype)
    gate_up = (torch.randn(5, 2 * 48, generator=gen) * 2).to(dtype)
    gate_up[1] = 0
    product = silu_and_mul_ref(gate_up)
    for op in (silu_and_mul_quant, silu_and_mul_quant_ref):
        rows = op(gate_up, qdtype, divisor, scale)
        assert_same_rows(rows, *w8.quantize_rows_ref(product, qdtype, scale, divisor), dtype)
        assert rows.q.shape == (5, 48) and not bool(rows.q[1].float().any())


X, WEIGHT = torch.randn(2, 16), torch.ones(16)


@pytest.mark.parametrize("call,match", [
    (lambda: rms_norm_quant(X, WEIGHT, 1e-5, None, torch.float16),
     r"qdtype: expected torch\.int8 or torch\.float8_e4m3fn, got torch\.float16"),
    (lambda: rms_norm_quant(X, WEIGHT, 1e-5, None, torch.int8, 0.0),
     r"divisor: expected a positive scale divisor, got 0\.0"),
    (lambda: rms_norm_quant(X, torch.ones(10), 1e-5, None, torch.int8),
     r"weight: expected \[16\], got \(10,\)"),
    (lambda: rms_norm_quant(X, WEIGHT, 1e-5, torch.ones(3, 16), FP8),
     r"residual: expected \(2, 16\), got \(3, 16\)"),
    (lambda: rms_norm_quant(X.view(2, 2, 8), torch.ones(8), 1e-5, None, FP8),
     r"x: expected \[num_tokens, hidden\], got \(2, 2, 8\)"),
    (lambda: silu_and_mul_quant(torch.randn(2, 15), torch.int8),
     r"x: expected \[num_tokens, 2 \* d\] \(gate \| up\), got \(2, 15\)"),
    (lambda: silu_and_mul_quant(X, torch.bfloat16), r"qdtype: expected torch\.int8"),
    (lambda: silu_and_mul_quant(X, FP8, -1.0), r"divisor: expected a positive scale divisor"),
], ids=["qdtype", "divisor", "weight", "residual", "x-dims", "silu-x", "silu-qdtype",
        "silu-divisor"])
def test_fused_ops_name_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_projection_of_quantized_rows_equals_that_of_the_float_rows(dtype, static):
    """A W8A8 projection handed QuantizedRows (w8a8_linear; scaled_gemm, the cuBLAS path's
    calls, here on torch's CPU kernels) gives what it gives for the float rows they were
    quantized from, bit for bit; it does not quantize them again."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    qweight, weight_scale = w8.quantize_weight(torch.randn(48, 64, generator=gen), dtype)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    input_scale = torch.tensor(0.02) if static else None
    divisor = w8.COMPRESSED_TENSORS_DIVISOR[dtype]
    rows = w8.QuantizedRows(*w8.quantize_rows(x, dtype, input_scale, divisor), x.dtype)
    want = w8.w8a8_linear_ref(x, qweight, weight_scale, input_scale, bias,
                              act_scale_divisor=divisor)
    got = w8.w8a8_linear(rows, qweight, weight_scale, input_scale, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    want = w8.scaled_gemm(x, qweight, weight_scale, input_scale, bias, act_scale_divisor=divisor)
    assert torch.equal(w8.scaled_gemm(rows, qweight, weight_scale, None, bias), want)


def test_quantized_rows_of_another_type_or_shape_are_refused():
    qweight, weight_scale = w8.quantize_weight(torch.randn(8, 32), torch.int8)
    q, scales = w8.quantize_rows(torch.randn(3, 32), FP8)
    with pytest.raises(ValueError, match=r"x: expected rows quantized to torch\.int8 "
                                         r"\[num_tokens, 32\], got torch\.float8_e4m3fn"):
        w8.w8a8_linear(w8.QuantizedRows(q, scales, torch.float32), qweight, weight_scale)
    q, _ = w8.quantize_rows(torch.randn(3, 32), torch.int8)
    with pytest.raises(ValueError, match=r"x: expected float32 scales \(3, 1\), got "
                                         r"torch\.float32 \(3,\)"):
        w8.w8a8_linear(w8.QuantizedRows(q, scales.view(3), torch.float32), qweight,
                       weight_scale)


def test_no_fusion_on_the_cpu():
    """On the CPU the op before a projection hands over float rows, as before the fusion."""
    x = torch.randn(3, 64).to(torch.bfloat16)
    qweight, _ = w8.quantize_weight(torch.randn(48, 64), torch.int8)
    for op in ("rms_norm_quant", "silu_and_mul_quant"):
        assert not w8.input_quant_fusable(op, x, qweight, None)
