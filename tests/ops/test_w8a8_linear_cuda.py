"""The CUDA path of ops/w8a8_linear.py (torch._int_mm / torch._scaled_mm through cuBLAS)
against an exact float64 reference of the same quantized values, on awkward shapes.

The reference takes x quantized on the GPU by the op's own torch ops (the same values the CPU
gives: the scale is max|x| / divisor, an IEEE division; then x / scale for int8, rounded half
to even, and x times the scale's rounded reciprocal for FP8)
and forms the exact product sum in float64, so the tolerance is what the GEMM may add to it,
element by element:

    |out - ref| <= 2 u (|ref| + |bias|) + a S + 1e-6 max|ref|

u: the output dtype's unit roundoff (bfloat16 2^-8, float16 2^-11), for the final rounding and
the bias addition; S = (|qx| @ |qw|.T) * x_scale * weight_scale, the accumulation's scale, with
a = 4 k 2^-24 for int8 (exact int32 sums; only their conversion to float32 and the rescaling
round) and a = max(4 k 2^-24, 2^-12) for fp8: fp32 accumulation in another order, and Hopper's
FP8 tensor cores keep about 14 bits between cuBLAS's promotions to fp32 (DeepSeek-V3 report),
bounded here at 4x that. (On torch's CPU kernels the same calls stay under half this bound.)
"""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops import w8a8_linear as w8

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FP8 = torch.float8_e4m3fn
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
FP8_ACCUMULATION = 2.0 ** -12
"""Relative accumulation error allowed for fp8 GEMMs (see the module docstring)."""


def needs(dtype):
    cc = torch.cuda.get_device_capability()
    need = w8.INT8_MIN_CAPABILITY if dtype == torch.int8 else w8.FP8_MIN_CAPABILITY
    if cc < need:
        pytest.skip(f"{dtype} GEMMs need compute capability {need}, the device has {cc}")


def make(m, n, k, wdtype, dtype, seed, static):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    x[m // 2, : k // 3] = 0  # a partly zero row
    w = torch.randn(n, k, generator=gen) * 0.02
    w[1] = 0  # an all-zero output channel
    qweight, weight_scale = w8.quantize_weight(w, wdtype)
    input_scale = (x.float().abs().max() / w8.QMAX[wdtype] * 0.7) if static else None  # clips
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    return x, qweight, weight_scale, input_scale, bias


def exact(x, qweight, weight_scale, input_scale, bias, divisor=None):
    """(reference [m, n] float64, S the bound's absolute sum) on the CPU, from x quantized on
    the GPU as the op quantizes it (the CPU gives the same values; the GEMM is what is checked)."""
    qx, sx = w8.quantize_rows(x.cuda(), qweight.dtype,
                              None if input_scale is None else input_scale.cuda(), divisor)
    qx, sx = qx.cpu(), sx.cpu()
    qx, qw = qx.double(), qweight.cpu().double()
    scale = sx.double() * weight_scale.cpu().double()
    ref = (qx @ qw.t()) * scale
    if bias is not None:
        ref = ref + bias.cpu().double()
    return ref, (qx.abs() @ qw.abs().t()) * scale


def check(out, x, qweight, weight_scale, input_scale, bias, divisor=None):
    assert out.is_cuda and out.dtype == x.dtype and bool(torch.isfinite(out).all())
    ref, total = exact(x, qweight, weight_scale, input_scale, bias, divisor)
    k, u = qweight.shape[1], UNIT_ROUNDOFF[x.dtype]
    a = 4 * k * 2.0 ** -24
    if qweight.dtype == FP8:
        a = max(a, FP8_ACCUMULATION)
    b = 0 if bias is None else bias.cpu().double().abs()
    bound = 2 * u * (ref.abs() + b) + a * total + 1e-6 * ref.abs().max()
    err = (out.cpu().double() - ref).abs()
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (f"error {err.flatten()[worst].item():.3g} over bound "
                                       f"{bound.flatten()[worst].item():.3g}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 100])
@pytest.mark.parametrize("n,k", [(96, 160), (4096, 4096), (1536, 576), (40, 96)])
def test_matches_the_exact_reference(dtype, wdtype, static, m, n, k):
    needs(wdtype)
    seed = m * 7919 + n * 31 + k + static
    x, qweight, weight_scale, input_scale, bias = make(m, n, k, wdtype, dtype, seed, static)
    cuda = [t.cuda() if t is not None else None
            for t in (x, qweight, weight_scale, input_scale, bias)]
    # Shapes cuBLAS serves take it (n = 40 is not a multiple of 16: fp8 runs the reference).
    align = w8.INT8_ALIGN if wdtype == torch.int8 else w8.FP8_ALIGN
    assert w8.cuda_supported(cuda[0], cuda[1]) == (n % align == 0 and k % align == 0)
    out = w8.w8a8_linear(*cuda)
    check(out, x, qweight, weight_scale, input_scale, bias)
    check(w8.w8a8_linear(*cuda[:4]), x, qweight, weight_scale, input_scale, None)


@pytest.mark.parametrize("wdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 17, 100])
def test_compressed_tensors_divisor_reaches_the_gemm_path(wdtype, m):
    """act_scale_divisor (compressed-tensors' 127.5 / 448) goes through the cuBLAS path's
    quantization: the exact reference of the values quantized with it, and for int8 other
    values than with QMAX."""
    needs(wdtype)
    x, qweight, weight_scale, _, bias = make(m, 256, 512, wdtype, torch.bfloat16, 13 + m, False)
    divisor = w8.COMPRESSED_TENSORS_DIVISOR[wdtype]
    cuda = [t.cuda() for t in (x, qweight, weight_scale)]
    out = w8.w8a8_linear(*cuda, None, bias.cuda(), act_scale_divisor=divisor)
    check(out, x, qweight, weight_scale, None, bias, divisor)
    if wdtype == torch.int8:
        q_ct, _ = w8.quantize_rows(cuda[0], wdtype, divisor=divisor)
        q_vllm, _ = w8.quantize_rows(cuda[0], wdtype)
        assert not torch.equal(q_ct, q_vllm)


@pytest.mark.parametrize("wdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_leading_dims_and_a_strided_input(wdtype):
    needs(wdtype)
    x, qweight, weight_scale, _, bias = make(6, 256, 512, wdtype, torch.bfloat16, 5, False)
    wide = torch.zeros(6, 1024, dtype=torch.bfloat16)
    wide[:, 256:768] = x  # a view with row stride 1024
    cuda = [t.cuda() for t in (wide, qweight, weight_scale, bias)]
    out = w8.w8a8_linear(cuda[0][:, 256:768].view(2, 3, 512), cuda[1], cuda[2], None, cuda[3])
    assert out.shape == (2, 3, 256)
    check(out.view(6, 256), x, qweight, weight_scale, None, bias)


@pytest.mark.parametrize("wdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 17])
def test_cuda_graph_replay_equals_eager(wdtype, m):
    """The decode path is captured in CUDA graphs: no host sync, and padding (int8, m <= 16)
    inside the graph."""
    needs(wdtype)
    x, qweight, weight_scale, _, bias = make(m, 512, 256, wdtype, torch.bfloat16, 7, False)
    x, qweight, weight_scale, bias = (t.cuda() for t in (x, qweight, weight_scale, bias))
    eager = w8.w8a8_linear(x, qweight, weight_scale, None, bias)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w8.w8a8_linear(static_x, qweight, weight_scale, None, bias)  # warm up cuBLAS
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = w8.w8a8_linear(static_x, qweight, weight_scale, None, bias)
    static_x.copy_(x * 2)
    graph.replay()
    torch.testing.assert_close(static_out, w8.w8a8_linear(x * 2, qweight, weight_scale, None,
                                                          bias), rtol=0, atol=0)
    static_x.copy_(x)
    graph.replay()
    torch.testing.assert_close(static_out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_synthetic_model_runs_w8a8_on_the_gpu(method):
    """`--model ... --quantization int8|fp8` makes its W8A8 weights on the GPU, in bfloat16."""
    from tinyvllm.model.quantization.layer import W8A8Linear
    from tinyvllm.model.synthetic import make_random_quantized_model, tiny_arch

    wdtype = torch.int8 if method == "int8" else FP8
    needs(wdtype)
    net = make_random_quantized_model(tiny_arch(), 3, torch.bfloat16, torch.device("cuda"),
                                      method)
    down = net.model.layers[0].mlp.down_proj
    assert isinstance(down, W8A8Linear) and down.qweight.is_cuda and down.qweight.dtype == wdtype
    x = torch.randn(5, down.in_features, device="cuda", dtype=torch.bfloat16)
    check(down(x), x.cpu(), down.qweight, down.weight_scale, None, None)


@pytest.mark.parametrize("wdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("convention", sorted(w8.ACT_SCALE_DIVISORS))
def test_quantization_is_the_same_on_cpu_and_gpu(wdtype, convention):
    """Dynamic per-token scales and values, with either convention's divisor: the CPU tests
    predict the GPU's quantization, by the kernel and by the torch reference on the GPU (which
    divides by a tensor: CUDA would multiply by the reciprocal of a Python number)."""
    x = (torch.randn(64, 576, generator=torch.Generator().manual_seed(11)) * 3).to(torch.bfloat16)
    divisor = w8.ACT_SCALE_DIVISORS[convention][wdtype]
    q_cpu, s_cpu = w8.quantize_rows(x, wdtype, divisor=divisor)
    for quantize in (w8.quantize_rows, w8.quantize_rows_ref):
        q_gpu, s_gpu = quantize(x.cuda(), wdtype, divisor=divisor)
        assert torch.equal(s_gpu.cpu(), s_cpu)
        assert torch.equal(q_gpu.cpu().float(), q_cpu.float())


@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, k, pad", [(1, 16, 0), (5, 40, 0), (33, 4096, 0), (3, 14336, 0),
                                       (7, 576, 8), (2, 40, 3)])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("convention", sorted(w8.ACT_SCALE_DIVISORS))
def test_quantize_rows_kernel_equals_reference(qdtype, dtype, m, k, pad, static, convention):
    """The one-pass kernel gives the reference's quantized values and scales bit for bit: wide
    and single-element accesses (k = 40 and a row stride k + 3 are not 16-byte multiples), a
    strided view, an all-zero row, static scales that clip, dynamic scales divided by either
    convention's divisor (int8: 127 or compressed-tensors' 127.5)."""
    gen = torch.Generator().manual_seed(m * k + pad)
    full = (torch.randn(m, k + pad, generator=gen) * 3).to(dtype).cuda()
    x = full[:, :k]
    scale = (x.float().abs().max() / w8.QMAX[qdtype] * 0.6).reshape(()) if static else None
    x[m // 2] = 0
    assert w8.use_kernel("quantize_rows", x) is not None
    divisor = w8.ACT_SCALE_DIVISORS[convention][qdtype]
    q, s = w8.quantize_rows(x, qdtype, scale, divisor)
    q_ref, s_ref = w8.quantize_rows_ref(x, qdtype, scale, divisor)
    assert q.dtype == qdtype and q.shape == (m, k) and s.shape == (m, 1)
    assert torch.equal(s.float(), s_ref.float().expand(m, 1))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quantize_rows_kernel_refuses_bad_types():
    x = torch.randn(2, 16, device="cuda", dtype=torch.bfloat16)
    kernel = w8.use_kernel("quantize_rows", x)

    def launch(qdtype, scale_divisor):
        kernel.quantize_rows(out=x.data_ptr(), scales=x.data_ptr(), x=x.data_ptr(),
                             static_scale=0, num_tokens=2, k=16, x_stride=16, out_stride=16,
                             qmax=127.0, scale_divisor=scale_divisor, min_absmax=1e-10,
                             dtype=w8.dtype_code(x.dtype), qdtype=w8.dtype_code(qdtype),
                             stream=0)

    with pytest.raises(ValueError, match="qdtype must be int8 or float8_e4m3fn"):
        launch(torch.float16, 127.0)
    with pytest.raises(ValueError, match="scale_divisor must be positive and finite"):
        launch(torch.int8, 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n", [(1, 16), (17, 4096), (5, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_epilogue_kernel_equals_torch_ops(dtype, m, n, with_bias):
    """The int8 GEMM's one-pass epilogue rounds as the torch ops it replaces, bit for bit: the
    int32 sums (of a padded GEMM, so a row view) times the token's and the channel's scale, plus
    the bias, in float32, rounded once to the output dtype."""
    gen = torch.Generator().manual_seed(m + n)
    acc = torch.randint(-2 ** 24, 2 ** 24, (m + 3, n), generator=gen, dtype=torch.int32).cuda()[:m]
    x_scale = (torch.rand(m, 1, generator=gen) * 1e-2).cuda()
    w_scale = (torch.rand(n, generator=gen) * 1e-3).cuda()
    bias = (torch.randn(n, generator=gen)).to(dtype).cuda() if with_bias else None
    expected = acc.float() * x_scale * w_scale
    expected = (expected if bias is None else expected + bias.float()).to(dtype)
    kernel = w8.use_kernel("quantize_rows", acc)
    out = torch.empty(m, n, dtype=dtype, device="cuda")
    kernel.rescale_int32(out=out.data_ptr(), acc=acc.data_ptr(), x_scale=x_scale.data_ptr(),
                         w_scale=w_scale.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
                         m=m, n=n, acc_stride=acc.stride(0), out_stride=n,
                         dtype=w8.dtype_code(dtype), stream=0)
    assert torch.equal(out, expected)
