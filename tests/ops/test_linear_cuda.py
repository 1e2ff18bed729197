"""The fused decode GEMV (cuda/gemv.cuh) against its torch reference, and the decoder using it."""

from __future__ import annotations

import pytest
import torch

from tinyvllm import ops
from tinyvllm.config import KernelConfig
from tinyvllm.ops import linear
from tinyvllm.ops._dispatch import dtype_code
from tinyvllm.ops.attention import DecodePartitions
from tinyvllm.ops.linear import fused_linear, fused_linear_ref, fused_linear_supported

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rand(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_fused_linear(dtype, m, n, k, prologue, epilogue, kernel):
    """One fused_linear case against its torch reference, on the GEMV `kernel` (0 scalar, 1
    tensor cores): random inputs, the output written into a NaN-filled buffer whose extra row
    stays unwritten, or the residual updated in place."""
    seed = m * 7919 + n * 31 + k
    swiglu = epilogue == "silu_mul_out"  # n outputs from 2n rows (gate | up)
    rows = 2 * n if swiglu else n
    x = rand(m, 2 * k if prologue == "silu_mul" else k, dtype=dtype, seed=seed)
    weight = rand(rows, k, dtype=dtype, seed=seed + 1, scale=k ** -0.5)
    bias = rand(rows, dtype=dtype, seed=seed + 2) if epilogue in ("bias", "silu_mul_out") else None
    norm_weight = rand(k, dtype=dtype, seed=seed + 3) if prologue == "rms_norm" else None
    residual = rand(m, n, dtype=dtype, seed=seed + 4) if epilogue == "residual" else None
    kwargs = dict(norm_weight=norm_weight, eps=1e-5, silu_mul=prologue == "silu_mul",
                  silu_mul_out=swiglu)
    assert fused_linear_supported(x, weight) and linear._gemv_kernel(m, x, weight) == kernel

    expected = fused_linear_ref(x, weight, bias,
                                residual=None if residual is None else residual.clone(), **kwargs)
    if residual is None:
        out = torch.full((m + 1, n), float("nan"), dtype=dtype, device="cuda")
        got = fused_linear(x, weight, bias, out=out[:m], **kwargs)
        assert got.data_ptr() == out.data_ptr()
        assert out[m].isnan().all()  # no row past m written
    else:
        got = fused_linear(x, weight, bias, residual=residual, **kwargs)
        assert got is residual
    assert rel_err(got, expected) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", [(7, 8), (1001, 584), (576, 1536), (4104, 4096), (96, 14336)])
@pytest.mark.parametrize("prologue", [None, "rms_norm", "silu_mul"])
@pytest.mark.parametrize("epilogue", ["plain", "bias", "residual", "silu_mul_out"])
def test_fused_linear_matches_reference(dtype, m, n, k, prologue, epilogue):
    if epilogue == "silu_mul_out" and prologue == "silu_mul":
        pytest.skip("one SwiGLU per projection")
    check_fused_linear(dtype, m, n, k, prologue, epilogue, kernel=0)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", [(7, 8), (4096, 4096), (1001, 584), (96, 14336)])
def test_fused_linear_prefetch_weight_changes_nothing(m, n, k):
    """The L2 prefetch of the whole weight (o_proj after attention) moves no value: the output is
    bit-identical to the launch without it, whatever the rows per warp (one, several, ragged)."""
    seed = 17 * m + n + k
    x = rand(m, k, dtype=torch.bfloat16, seed=seed)
    weight = rand(n, k, dtype=torch.bfloat16, seed=seed + 1, scale=k ** -0.5)
    residual = rand(m, n, dtype=torch.bfloat16, seed=seed + 2)
    plain = fused_linear(x, weight, residual=residual.clone())
    got = fused_linear(x, weight, residual=residual.clone(), prefetch_weight=True)
    assert torch.equal(got, plain)
    assert rel_err(got, fused_linear_ref(x, weight, residual=residual.clone())) <= 1e-2


def test_fused_linear_strided_rows_and_large_vocab():
    """Rows picked out of a wider buffer (qkv views), and an lm_head-sized weight."""
    dtype = torch.bfloat16
    wide = rand(2, 1024, dtype=dtype, seed=5)
    x = wide[:, :576]  # row stride 1024
    weight = rand(49152, 576, dtype=dtype, seed=6, scale=576 ** -0.5)
    assert rel_err(fused_linear(x, weight), fused_linear_ref(x, weight)) <= REL_TOL[dtype]


def test_fused_linear_silu_mul_out_equals_the_two_step_path():
    """gate_up with the SwiGLU epilogue writes exactly what gate_up then the silu_mul prologue's
    rounding would give (y to T, silu(gate) to T, the product to T), for both row counts."""
    for m in (1, 2):
        x = rand(m, 4096, dtype=torch.bfloat16, seed=40 + m)
        weight = rand(2 * 14336, 4096, dtype=torch.bfloat16, seed=50, scale=4096 ** -0.5)
        norm_weight = rand(4096, dtype=torch.bfloat16, seed=51)
        gate_up = fused_linear(x, weight, norm_weight=norm_weight, eps=1e-5)
        got = fused_linear(x, weight, norm_weight=norm_weight, eps=1e-5, silu_mul_out=True)
        g, u = gate_up.float().chunk(2, dim=-1)
        want = (torch.nn.functional.silu(g).to(torch.bfloat16).float() * u).to(torch.bfloat16)
        assert got.shape == (m, 14336)
        assert rel_err(got, want) <= 1e-2
        assert (got != want).float().mean() < 1e-3  # expf vs torch's exp: rare last-bit flips


@pytest.fixture
def tensor_cores_only():
    """Every decode-sized batch (1-16 rows) on the tensor-core GEMV."""
    ops.configure(KernelConfig(gemv_max_rows=0))
    yield
    ops.configure(KernelConfig())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("n,k", [(16, 64), (48, 576), (960, 576), (576, 1536), (4096, 4096),
                                 (32, 14336)])
@pytest.mark.parametrize("prologue", [None, "rms_norm", "silu_mul"])
@pytest.mark.parametrize("epilogue", ["plain", "bias", "residual", "silu_mul_out"])
def test_tensor_core_gemv_matches_reference(tensor_cores_only, dtype, m, n, k, prologue,
                                            epilogue):
    """The tensor-core GEMV (cuda/gemv_mma.cuh) with every prologue and epilogue: k of 1 to 224
    tiles (warps with no tile, several, ragged), one band to 256, 1 to 16 rows (one mma column
    group, two)."""
    if epilogue == "silu_mul_out" and prologue == "silu_mul":
        pytest.skip("one SwiGLU per projection")
    if m > 4 and k == 14336:
        pytest.skip("8 rows of k = 14336 exceed the staging: cuBLAS serves them")
    check_fused_linear(dtype, m, n, k, prologue, epilogue, kernel=1)


def rows_alone_equal_rows_in_steps(k: int, prologue, num_rows: int, step_sizes, seed: int):
    """Rows of a random x through `fused_linear` (residual epilogue) one at a time, then in steps
    of m rows, reversed so that every row moves: the same bits. Returns (x, weight, residual,
    the prologue's kwargs, the rows alone)."""
    dtype, n = torch.bfloat16, 960
    weight = rand(n, k, dtype=dtype, seed=seed, scale=k ** -0.5)
    x = rand(num_rows, 2 * k if prologue == "silu_mul" else k, dtype=dtype, seed=seed + 1)
    residual = rand(num_rows, n, dtype=dtype, seed=seed + 2)
    kwargs = dict(norm_weight=rand(k, dtype=dtype, seed=seed + 3) if prologue == "rms_norm"
                  else None, silu_mul=prologue == "silu_mul")
    alone = torch.cat([fused_linear(x[i:i + 1], weight, residual=residual[i:i + 1].clone(),
                                    **kwargs) for i in range(num_rows)])
    for m in step_sizes:
        order = torch.arange(m, device="cuda").flip(0)
        got = fused_linear(x[order].contiguous(), weight,
                           residual=residual[order].contiguous(), **kwargs)
        assert torch.equal(got, alone[order]), f"m={m}"
    return x, weight, residual, kwargs, alone


@pytest.mark.parametrize("kernel_rows", [(2, 2), (0, 16)])  # (gemv_max_rows, most rows)
@pytest.mark.parametrize("prologue", [None, "rms_norm", "silu_mul"])
@pytest.mark.parametrize("k", [576, 4096])
def test_gemv_rows_do_not_depend_on_the_batch(kernel_rows, prologue, k):
    """A row of x gives the same bits alone and anywhere among other rows, on the scalar GEMV (1-2
    rows) and the tensor-core one (1-16): each row's norm and dot products are summed in an order
    that does not depend on its position (CUDA graphs pad batches, speculation verifies rows)."""
    scalar_rows, most = kernel_rows
    ops.configure(KernelConfig(gemv_max_rows=scalar_rows))
    try:
        rows_alone_equal_rows_in_steps(k, prologue, 16,
                                       [m for m in (2, 3, 5, 8, 9, 16) if m <= most], seed=60)
    finally:
        ops.configure(KernelConfig())


def test_tensor_core_gemv_partial_band_and_errors():
    """n not a multiple of 16 (the last band's rows past n are zero-filled, never written), and
    what the tensor-core kernel refuses, by name."""
    from tinyvllm.ops._dispatch import cuda_ops
    x = rand(5, 640, dtype=torch.bfloat16, seed=70)
    weight = rand(1000, 640, dtype=torch.bfloat16, seed=71, scale=640 ** -0.5)
    out = torch.full((5, 1008), float("nan"), dtype=torch.bfloat16, device="cuda")
    cuda_ops().gemv(**gemv_args(x, weight, out=out.data_ptr(), out_stride=1008, mma=1))
    assert rel_err(out[:, :1000], fused_linear_ref(x, weight)) <= 1e-2
    assert out[:, 1000:].isnan().all()
    with pytest.raises(ValueError, match="m=17 rows; at most 16"):
        cuda_ops().gemv(**gemv_args(x, weight, m=17, mma=1))
    with pytest.raises(ValueError, match="k=584 must be a positive multiple of 64"):
        cuda_ops().gemv(**gemv_args(x, weight, k=584, mma=1))
    with pytest.raises(ValueError, match="staging"):
        cuda_ops().gemv(**gemv_args(x, weight, k=14336, mma=1))  # 8 x 14336 activations
    with pytest.raises(ValueError, match="silu_mul_out needs n=1000 a multiple of 16"):
        cuda_ops().gemv(**gemv_args(x, weight, silu_mul_out=1, mma=1))
    with pytest.raises(ValueError, match="mma=3 unknown"):
        cuda_ops().gemv(**gemv_args(x, weight, mma=3))


def gemv_args(x: torch.Tensor, weight: torch.Tensor, **changes) -> dict:
    """Keyword arguments of `_cuda.gemv` for x @ weight.T into a null output, with changes."""
    m, (n, k) = x.shape[0], weight.shape
    args = dict(out=0, x=x.data_ptr(), weight=weight.data_ptr(), bias=0, residual=0,
                norm_weight=0, m=m, n=n, k=k, x_stride=k, out_stride=n, residual_stride=n,
                eps=1e-5, prologue=0, silu_mul_out=0, prefetch_weight=0, mma=0,
                dtype=dtype_code(x.dtype), stream=0)
    return {**args, **changes}


def test_fused_linear_rejects_what_it_cannot_serve():
    from tinyvllm.ops._dispatch import cuda_ops
    x = rand(2, 12, dtype=torch.bfloat16, seed=7)
    weight = rand(5, 12, dtype=torch.bfloat16, seed=8)
    assert not fused_linear_supported(x, weight)  # k % 8 != 0: the caller keeps cuBLAS
    assert not fused_linear_supported(rand(3, 16, dtype=torch.bfloat16, seed=9),
                                      rand(5, 16, dtype=torch.bfloat16, seed=10))
    with pytest.raises(ValueError, match="k=12"):
        cuda_ops().gemv(**gemv_args(x, weight))
    with pytest.raises(ValueError, match="m=3"):
        cuda_ops().gemv(**gemv_args(x, weight, m=3, k=16, x_stride=16))
    x16, w16 = rand(2, 16, dtype=torch.bfloat16, seed=11), rand(5, 16, dtype=torch.bfloat16, seed=12)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_linear(x16, w16, norm_weight=rand(8, dtype=torch.bfloat16, seed=13))
    with pytest.raises(ValueError, match="silu_mul_out needs an even number of weight rows"):
        fused_linear(x16, w16, silu_mul_out=True)  # 5 rows
    with pytest.raises(ValueError, match="silu_mul_out"):
        fused_linear(x16, rand(6, 16, dtype=torch.bfloat16, seed=14), silu_mul_out=True,
                     residual=rand(2, 3, dtype=torch.bfloat16, seed=15))
    with pytest.raises(ValueError, match="silu_mul_out"):
        cuda_ops().gemv(**gemv_args(x16, w16, silu_mul_out=1))
    with pytest.raises(ValueError, match="x: expected"):
        fused_linear(x16, w16, silu_mul=True)


def decode_step_logits(model, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """The logits of one decode step of `model` under the current kernel configuration: each
    sequence at context 37 over the same random cache contents at every call."""
    arch = model.arch
    block_size, context = 16, 37
    num_blocks = batch * 3 + 1
    positions = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    ids = torch.randint(0, arch.vocab_size, (batch,), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    tables = torch.arange(1, num_blocks, dtype=torch.int32, device="cuda").view(batch, 3)
    slots = (tables[:, context // block_size].long() * block_size + context % block_size)
    meta = ops.AttentionMetadata(
        num_tokens=batch, slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device="cuda"),
        block_tables=tables, max_query_len=1, max_seq_len=context + 1,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context + 1] * batch)
    caches = ops.allocate_kv_caches(arch.num_layers, num_blocks, block_size, arch.num_kv_heads,
                                    arch.head_dim, dtype, "cuda")
    for c in caches:
        c.copy_(rand(*c.shape, dtype=dtype, seed=c.numel() % 1000))
    return model.compute_logits(model(ids, positions, caches, meta))


def fused_and_unfused_logits(model, batch: int, dtype: torch.dtype
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_step_logits` with the fused projections and without them."""
    probe = torch.zeros(batch, model.arch.hidden_size, dtype=dtype, device="cuda")

    def step(fused: bool) -> torch.Tensor:
        ops.configure(KernelConfig(fused_gemv=fused))
        assert model.uses_fused_decode(probe) == fused
        return decode_step_logits(model, batch, dtype)

    try:
        return step(True), step(False)
    finally:
        ops.configure(KernelConfig())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2, 5, 16])  # 5, 16: the tensor-core GEMV
def test_decoder_fused_path_matches_unfused(dtype, batch):
    """A decode step through the fused projections gives the logits of the cuBLAS + ops path."""
    from tinyvllm.model.synthetic import make_random_model, tiny_arch

    arch = tiny_arch(hidden_size=256, intermediate_size=640, num_heads=4, num_kv_heads=2,
                     head_dim=64, vocab_size=1000, num_layers=3, attention_bias=True)
    model = make_random_model(arch, seed=3, dtype=dtype, device=torch.device("cuda"))
    fused, unfused = fused_and_unfused_logits(model, batch, dtype)
    assert rel_err(fused, unfused) <= REL_TOL[dtype]
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))


def test_dependent_chain_in_a_cuda_graph():
    """Back-to-back launches (each may start before the previous ends) read what it wrote, also
    when captured in a CUDA graph and replayed."""
    dtype = torch.bfloat16
    h = rand(1, 512, dtype=dtype, seed=20)
    w_up = rand(2048, 512, dtype=dtype, seed=21, scale=512 ** -0.5)
    w_down = rand(512, 1024, dtype=dtype, seed=22, scale=1024 ** -0.5)
    norm_w = rand(512, dtype=dtype, seed=23)

    def chain(stream_h):
        for _ in range(4):
            up = fused_linear(stream_h, w_up, norm_weight=norm_w, eps=1e-5)
            fused_linear(up, w_down, silu_mul=True, residual=stream_h)
        return stream_h

    expected = h.clone()
    for _ in range(4):
        up = fused_linear_ref(expected, w_up, norm_weight=norm_w, eps=1e-5)
        fused_linear_ref(up, w_down, silu_mul=True, residual=expected)
    eager = chain(h.clone())
    assert rel_err(eager, expected) <= REL_TOL[dtype]

    static = h.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static.clone())  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(static)
    static.copy_(h)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)


def random_partitions(m, num_heads, head_dim, dtype, seed, num_splits=6, partition=64):
    """A split decode's partitions for m sequences of ragged lengths; partitions past a
    sequence's end hold NaN (never read)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = torch.tensor([300, 64, 1, 129, 17][:m], dtype=torch.int32, device="cuda")
    out = torch.randn(m, num_heads, num_splits, head_dim, generator=gen, device="cuda")
    stats = torch.randn(2, m, num_heads, num_splits, generator=gen, device="cuda")
    mx, sm = stats[0] * 4, stats[1].abs() * 5 + 1
    for i, n in enumerate(seq_lens.tolist()):
        used = -(-n // partition)
        out[i, :, used:] = mx[i, :, used:] = sm[i, :, used:] = float("nan")
    return DecodePartitions(out, mx, sm, seq_lens, partition, dtype)


def merge_ref(parts: DecodePartitions) -> torch.Tensor:
    """Float64 softmax-weighted mean of each sequence's used partitions."""
    rows = []
    for i, n in enumerate(parts.seq_lens.tolist()):
        used = -(-n // parts.partition_size)
        mx, sm = parts.max[i, :, :used].double(), parts.sum[i, :, :used].double()
        w = sm * torch.exp2(mx - mx.max(dim=-1, keepdim=True).values)
        rows.append((w[..., None] * parts.out[i, :, :used].double()).sum(1) / w.sum(-1)[:, None])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5])  # 3, 5: the tensor-core GEMV merges them
@pytest.mark.parametrize("num_heads,head_dim", [(9, 64), (8, 128), (32, 128)])
def test_fused_linear_merges_decode_partitions(dtype, m, num_heads, head_dim):
    """o_proj straight from a split decode's partitions: the merge launch's result bit for bit
    (same roundings), which matches the float64 merge; the residual is updated in place."""
    seed = m * 101 + num_heads
    parts = random_partitions(m, num_heads, head_dim, dtype, seed)
    merged = parts.merge()
    assert rel_err(merged, merge_ref(parts)) <= REL_TOL[dtype]
    k = num_heads * head_dim
    weight = rand(576, k, dtype=dtype, seed=seed + 1, scale=k ** -0.5)
    residual = rand(m, 576, dtype=dtype, seed=seed + 2)
    expected = fused_linear(merged.view(m, k), weight, residual=residual.clone())
    got = fused_linear(parts, weight, residual=residual)
    assert got is residual
    assert torch.equal(got, expected)
    plain = fused_linear(parts, weight)  # no residual: a new tensor
    assert torch.equal(plain, fused_linear(merged.view(m, k), weight))


@pytest.mark.parametrize("prologue", [None, "rms_norm", "silu_mul"])
@pytest.mark.parametrize("k", [576, 14336])
def test_batch_invariant_rows_do_not_depend_on_the_step(prologue, k):
    """Under batch_invariant a step of any size is one tensor-core GEMV launch in chunks of 16
    rows (4 at k = 14336, where its staging holds no more), one row of CTAs each: a row gives the
    same bits alone and anywhere in a step of 17 or 40 rows (a prefill chunk, a mixed step, a
    large verification)."""
    ops.configure(KernelConfig(batch_invariant=True))
    try:
        x, weight, residual, kwargs, alone = rows_alone_equal_rows_in_steps(
            k, prologue, 40, (17, 40), seed=70)
        expected = fused_linear_ref(x, weight, residual=residual.clone(), **kwargs)
        assert rel_err(alone, expected) <= REL_TOL[torch.bfloat16]
        if prologue is None:  # gate_up's SwiGLU epilogue, into a new tensor
            swiglu = rand(2 * weight.shape[0], k, dtype=torch.bfloat16, seed=74, scale=k ** -0.5)
            one = torch.cat([fused_linear(x[i:i + 1], swiglu, silu_mul_out=True)
                             for i in range(40)])
            assert torch.equal(fused_linear(x, swiglu, silu_mul_out=True), one)
    finally:
        ops.configure(KernelConfig())
