"""The CPU kernels over packed GGUF blocks (`tinyvllm._cpu` through `ops.quantized`) against their
torch references, on every instruction set this machine runs plus the forced scalar path.

The kernels quantize each activation row to int8 per 32 values and take integer dot products, so
against `quantized_linear_ref` (the same int8 round trip in torch, the weight dequantized by
`gguf.quants`) only the float summation order differs: the stated bound is 1e-5 of the sum of
|terms|. Against plain F.linear over the dequantized weight (the `--dequantize` path) the
difference is the activations' rounding, at most half a quantization step per value.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tinyvllm.ops import quantized as q

_cpu = pytest.importorskip("tinyvllm._cpu")

ISAS = ["scalar"] + [isa for isa in ("avx2", "avx512vnni") if q.isa_available(isa)]
TYPES = sorted(q.KERNEL_TYPES.items())
K_TYPES = sorted(q.KQUANT_TYPES.items())
SUM_ORDER_RTOL = 1e-5


def _packed(n: int, k: int, qtype: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [n, row_bytes] as gguf quantizes it, its dequantized float [n, k])."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    qweight = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
    return qweight, q.dequantize(qweight, qtype, k)


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Random rows; row 0 also holds exact rounding ties (max 127 -> d = 1: 2.5 -> 2, -3.5 -> -4)
    and a block of zeros (d = 0)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    if k >= 64:
        x[0, 32:64] = 0.0
    return x


def _assert_sum_order_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                            bias: torch.Tensor | None) -> None:
    xq = q.quantize_activations_ref(x)
    want = F.linear(xq, w, bias)
    bound = SUM_ORDER_RTOL * (F.linear(xq.abs(), w.abs()) + (0 if bias is None else bias.abs()))
    err = (got - want).abs()
    assert bool((err <= bound + 1e-6).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,qtype", TYPES)
def test_linear_matches_the_int8_reference_on_awkward_shapes(type_name, qtype, isa, threads):
    q.set_num_threads(threads)
    try:
        for n, k in [(1, 32), (37, 96), (130, 576), (257, 64)]:  # n: not a multiple of 4 or T
            qweight, w = _packed(n, k, qtype, seed=n + k)
            bias = torch.randn(n) if n % 2 else None
            for m in range(1, 10):  # batch 1..9: GEMV, and every tile remainder of the GEMM
                x = _activations(m, k, seed=m)
                got = q.quantized_linear(x, qweight, qtype, k, bias, isa=isa)
                _assert_sum_order_close(got, x, w, bias)
    finally:
        q.set_num_threads(None)


@pytest.mark.parametrize("type_name,qtype", TYPES)
def test_large_batch_prefill_shape(type_name, qtype):
    """A prefill-sized batch (several activation chunks) on the threaded best path."""
    qweight, w = _packed(384, 576, qtype, seed=5)
    x = _activations(70, 576, seed=6)
    _assert_sum_order_close(q.quantized_linear(x, qweight, qtype, 576), x, w, None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,qtype", TYPES)
def test_difference_from_float_path_is_the_activation_rounding(type_name, qtype, isa):
    """|y - x @ W.T| <= sum_j |W_j| * (half step of x_j's block), plus the summation slack."""
    k = 192
    qweight, w = _packed(45, k, qtype, seed=9)
    x = _activations(7, k, seed=10)
    half_step = (x.reshape(7, -1, q.QBLOCK).abs().amax(-1, keepdim=True) / 127 / 2)
    bound = F.linear(half_step.expand(7, k // q.QBLOCK, q.QBLOCK).reshape(7, k), w.abs())
    got = q.quantized_linear(x, qweight, qtype, k, isa=isa)
    err = (got - q.dequantized_linear_ref(x, qweight, qtype, k)).abs()
    slack = SUM_ORDER_RTOL * F.linear(x.abs() * 1.01, w.abs())
    assert bool((err <= bound * 1.0001 + slack).all())


def test_kernel_writes_every_output_and_nothing_else():
    """Poisoned output with a row stride wider than n: columns < n written, the rest untouched."""
    qtype, n, k, m, stride = q.KERNEL_TYPES["Q4_1"], 19, 64, 5, 24
    qweight, w = _packed(n, k, qtype, seed=1)
    x = _activations(m, k, seed=2)
    out = torch.full((m, stride), float("nan"))
    _cpu.linear(out.data_ptr(), x.data_ptr(), qweight.data_ptr(), 0, qtype, m, n, k, k, stride)
    assert not bool(out[:, :n].isnan().any()) and bool(out[:, n:].isnan().all())
    _assert_sum_order_close(out[:, :n], x, w, None)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,qtype", TYPES)
def test_a_rows_result_does_not_depend_on_its_batch(type_name, qtype, isa, threads):
    """Bit for bit: each row alone (the GEMV tiles) equals that row inside a batch of 37 (GEMM
    tiles, the tail tiles of a chunk, any thread's share), so greedy output does not change with
    batch composition."""
    q.set_num_threads(threads)
    try:
        n, k = 131, 192  # n: a tail weight row after the 2- and 4-row tiles
        qweight, _ = _packed(n, k, qtype, seed=11)
        bias = torch.randn(n)
        x = _activations(37, k, seed=12)
        batch = q.quantized_linear(x, qweight, qtype, k, bias, isa=isa)
        for j in range(x.shape[0]):
            alone = q.quantized_linear(x[j:j + 1], qweight, qtype, k, bias, isa=isa)
            assert torch.equal(alone[0], batch[j]), f"row {j}"
        for m in range(2, 10):  # the small batches of a verification step (narrow tiles)
            small = q.quantized_linear(x[:m], qweight, qtype, k, bias, isa=isa)
            assert torch.equal(small, batch[:m]), f"batch of {m}"
    finally:
        q.set_num_threads(None)


@pytest.mark.skipif(len(ISAS) == 1, reason="needs a CPU with AVX2")
@pytest.mark.parametrize("type_name,qtype", TYPES)
@pytest.mark.parametrize("isa", ISAS[1:])
def test_scalar_and_simd_paths_agree_bit_for_bit(type_name, qtype, isa):
    """All follow one block dot contract (four lanes per block, kernels_avx2.cpp), so the scalar
    path is an exact oracle for the SIMD tiles (AVX2, and AVX-512 VNNI where the CPU has it):
    GEMV (m = 1), GEMM with tail rows, 2 to 8 activation rows (the narrow tiles), products past
    64 and 256 rows (a second pass over the weights on the AVX2 and AVX-512 paths) and more
    weight rows than one output group (16) holds."""
    for n, k, m in [(37, 96, 1), (130, 576, 9), (5, 1536, 4), (66, 576, 2), (9, 64, 3),
                    (40, 576, 19), (37, 96, 5), (131, 576, 7), (6, 64, 8), (13, 576, 6),
                    (70, 192, 65), (45, 96, 301)]:
        qweight, _ = _packed(n, k, qtype, seed=n)
        bias = torch.randn(n)
        x = _activations(m, k, seed=k)
        want = q.quantized_linear(x, qweight, qtype, k, bias, isa="scalar")
        assert torch.equal(q.quantized_linear(x, qweight, qtype, k, bias, isa=isa), want)


@pytest.mark.parametrize("type_name,qtype", TYPES)
def test_embedding_rows_equal_the_gguf_dequantization(type_name, qtype):
    qweight, w = _packed(50, 96, qtype, seed=3)
    ids = torch.tensor([[0, 49, 7], [7, 13, 0]])
    assert torch.equal(q.embedding_rows(qweight, qtype, 96, ids), w[ids])
    with pytest.raises(IndexError, match="row id 50 outside"):
        q.embedding_rows(qweight, qtype, 96, torch.tensor([50]))


def test_scalar_path_can_be_forced_by_environment(monkeypatch):
    monkeypatch.setenv("TINYVLLM_CPU_ISA", "scalar")
    assert _cpu.isa_name("auto") == "scalar"
    monkeypatch.setenv("TINYVLLM_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="isa: expected auto, avx512vnni, avx2 or scalar, got 'avx512'"):
        _cpu.isa_name("auto")


def test_bad_inputs_name_what_was_wrong():
    qweight, _ = _packed(4, 64, 3, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="qtype: expected"):
        q.quantized_linear(x, qweight, 10, 64)  # Q2_K: no kernel
    with pytest.raises(ValueError, match="k: expected a positive multiple of 32"):
        q.quantized_linear(torch.randn(2, 48), qweight, 3, 48)
    with pytest.raises(ValueError, match=r"qweight: expected a contiguous CPU uint8 \[n, 36\]"):
        q.quantized_linear(x, qweight, 2, 64)  # Q4_0 rows are 36 bytes, these are Q4_1's 40
    with pytest.raises(ValueError, match=r"x: expected a CPU float32 \[\.\.\., 64\]"):
        q.quantized_linear(x.double(), qweight, 3, 64)
    with pytest.raises(ValueError, match="bias: expected a contiguous float32 \\(4,\\)"):
        q.quantized_linear(x, qweight, 3, 64, torch.zeros(3))
    with pytest.raises(ValueError, match="isa: expected one of"):
        q.quantized_linear(x, qweight, 3, 64, isa="neon")
    with pytest.raises(ValueError, match="threads must be positive"):
        q.set_num_threads(-1)


def test_leading_dims_and_empty_batch():
    qweight, w = _packed(8, 64, 8, seed=4)
    x = _activations(6, 64, seed=5).reshape(2, 3, 64)
    got = q.quantized_linear(x, qweight, 8, 64)
    assert got.shape == (2, 3, 8)
    _assert_sum_order_close(got.reshape(6, 8), x.reshape(6, 64), w, None)
    assert q.quantized_linear(torch.empty(0, 64), qweight, 8, 64).shape == (0, 8)
    assert np.isfinite(got.numpy()).all()


# --- K-quants: activations int8 per 256 values, integer dot products -----------------------------

def _assert_float_sum_order_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                                  bias: torch.Tensor | None) -> None:
    """got = x's int8 round trip per 256 values (the K-quant kernels' activations) against w,
    up to float summation order."""
    xq = q.quantize_activations_ref(x, q.QK_K)
    want = F.linear(xq, w, bias)
    bound = SUM_ORDER_RTOL * (F.linear(xq.abs(), w.abs()) + (0 if bias is None else bias.abs()))
    err = (got - want).abs()
    assert bool((err <= bound + 1e-6).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,qtype", K_TYPES)
def test_kquant_linear_equals_the_int8_reference(type_name, qtype, isa, threads):
    """x rounded to int8 per 256 values (`quantize_activations_ref(x, 256)`) times
    dequantize(w), up to float summation order: the integer sums are exact. `quantized_linear_ref`
    is the same product; the unrounded x @ dequantize(w).T is within the activations' rounding."""
    q.set_num_threads(threads)
    try:
        for k in (256, 512, 2304):
            for n in (1, 7, 64):
                qweight = q.random_kquant_rows(n, k, qtype, seed=n + k)
                w = q.dequantize(qweight, qtype, k)
                assert bool(w.isfinite().all())
                bias = torch.randn(n) if n % 2 else None
                for m in (1, 3, 17):
                    x = _activations(m, k, seed=m)
                    got = q.quantized_linear(x, qweight, qtype, k, bias, isa=isa)
                    _assert_float_sum_order_close(got, x, w, bias)
                    _assert_float_sum_order_close(
                        q.quantized_linear_ref(x, qweight, qtype, k, bias), x, w, bias)
                    # against the unrounded x: each value moves by at most half a step
                    # (max|x| / 254 over its 256-value block)
                    step = x.reshape(m, -1, q.QK_K).abs().amax(-1, keepdim=True) / 254
                    half_step = step.expand(m, k // q.QK_K, q.QK_K).reshape(m, k)
                    bound = F.linear(half_step, w.abs()) * (1 + 1e-4) + 1e-5
                    assert bool(((got - F.linear(x, w, bias)).abs() <= bound).all())
    finally:
        q.set_num_threads(None)


@pytest.mark.parametrize("type_name,qtype", K_TYPES)
def test_kquant_every_isa_gives_the_same_bits(type_name, qtype):
    """Exact integer sums and one float expression per super-block: the SIMD paths (vpmaddubsw)
    and the portable one agree bit for bit, whatever the batch."""
    k, n = 1024, 37
    qweight = q.random_kquant_rows(n, k, qtype, seed=9)
    x = _activations(5, k, seed=10)
    outs = [q.quantized_linear(x, qweight, qtype, k, isa=isa) for isa in ISAS]
    for isa, out in zip(ISAS[1:], outs[1:]):
        assert torch.equal(out, outs[0]), f"{isa} against {ISAS[0]}"


@pytest.mark.parametrize("type_name,qtype", K_TYPES)
def test_kquant_kernel_writes_every_output_and_nothing_else(type_name, qtype):
    n, k, m, stride = 70, 512, 5, 75  # n: past one thread's share
    qweight = q.random_kquant_rows(n, k, qtype, seed=1)
    x = torch.randn(m, k)
    out = torch.full((m, stride), float("nan"))
    _cpu.linear(out.data_ptr(), x.data_ptr(), qweight.data_ptr(), 0, qtype, m, n, k, k, stride)
    assert not bool(out[:, :n].isnan().any()) and bool(out[:, n:].isnan().all())
    _assert_float_sum_order_close(out[:, :n], x, q.dequantize(qweight, qtype, k), None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,qtype", K_TYPES)
def test_kquant_rows_result_does_not_depend_on_its_batch(type_name, qtype, isa):
    n, k = 67, 512
    qweight = q.random_kquant_rows(n, k, qtype, seed=2)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(3))
    batch = q.quantized_linear(x, qweight, qtype, k, isa=isa)
    for j in range(x.shape[0]):
        assert torch.equal(q.quantized_linear(x[j:j + 1], qweight, qtype, k, isa=isa)[0],
                           batch[j]), f"row {j}"


@pytest.mark.parametrize("type_name,qtype", K_TYPES)
def test_kquant_embedding_rows_equal_the_gguf_dequantization_exactly(type_name, qtype):
    k = 768
    qweight = q.random_kquant_rows(40, k, qtype, seed=4)
    want = torch.from_numpy(gguf.quants.dequantize(
        qweight.numpy(), gguf.GGMLQuantizationType(qtype)).reshape(40, k))
    ids = torch.tensor([[0, 39, 7], [7, 13, 0]])
    assert torch.equal(q.embedding_rows(qweight, qtype, k, ids), want[ids])
    assert torch.equal(q.embedding_rows(qweight, qtype, k, torch.arange(40)), want)
    with pytest.raises(IndexError, match="row id 40 outside"):
        q.embedding_rows(qweight, qtype, k, torch.tensor([40]))


@pytest.mark.parametrize("type_name,qtype", K_TYPES)
def test_kquant_k_not_a_multiple_of_256_is_named(type_name, qtype):
    with pytest.raises(ValueError, match=f"k: expected a positive multiple of 256 for "
                                         f"{type_name}, got 320"):
        q.row_bytes(qtype, 320)
    assert q.row_bytes(qtype, 512) == 2 * q.BLOCK_BYTES[qtype]
    qweight = q.random_kquant_rows(4, 256, qtype, seed=5)
    with pytest.raises(ValueError, match="k: expected a positive multiple of 256"):
        q.quantized_linear(torch.randn(2, 288), qweight, qtype, 288)
    out, x = torch.empty(2, 4), torch.randn(2, 288)
    with pytest.raises(ValueError, match="k: expected a positive multiple of 256 .* got 288"):
        _cpu.linear(out.data_ptr(), x.data_ptr(), qweight.data_ptr(), 0, qtype, 2, 4, 288, 288,
                    4)
