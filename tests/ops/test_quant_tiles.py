"""The W4A16 tile layout (ops/quant_tiles.py): the repack against the integer-group layout it is
made from (CPU), and the tensor-core GEMV / dequantize kernels (cuda/quant_tiles.cuh) against the
torch reference of ops/quant_linear.py and ops/linear.py (GPU)."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.ops import quant_linear as ql
from tinyvllm.ops import quant_tiles as qt
from tinyvllm.ops._dispatch import runs_sm90a_code
from tinyvllm.ops.linear import fused_linear_ref


def make_weight(n, k, group_size, dtype, seed, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.int32)
    groups = k // group_size
    scales = (torch.rand(n, groups, generator=gen, device=device) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=gen, device=device).to(dtype)
    return ql.pack(q, 4), scales, zeros


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,group_size,interleave", [(7, 64, 64, False), (48, 192, 64, False),
                                                       (33, 128, 128, False),
                                                       (32, 256, 64, True), (64, 128, 128, True)])
def test_repack_round_trips_to_the_dequantized_weight(dtype, n, k, group_size, interleave):
    qweight, scales, zeros = make_weight(n, k, group_size, dtype, n + k)
    assert qt.tiles_supported(qweight, scales, zeros, 4, group_size)
    tiles = qt.repack(qweight, scales, zeros, group_size, interleave)
    bands = -(-n // 16)
    assert tiles.tiles.shape == (bands, k // 64, 32, 4) and tiles.tiles.dtype == torch.int32
    assert tiles.tile_scales.shape == (bands, k // group_size, 8, 2, 2)
    assert torch.equal(qt.dequantize_tiles(tiles), ql.dequantize(qweight, scales, zeros, 4,
                                                                 group_size))


def test_lane_words_hold_the_mma_fragments():
    # Row r, column c holds r * 64 + c mod 16: lane (g, t) word j nibble 0 is row g, column
    # 16j + 4t; nibble 1 is row g + 8 at the same column; nibble 4 is row g, column 16j + 4t + 1.
    n, k = 16, 64
    q = (torch.arange(n).view(n, 1) * 64 + torch.arange(k).view(1, k)) % 16
    scales = torch.ones(n, 1, dtype=torch.bfloat16)
    tiles = qt.repack(ql.pack(q.to(torch.int32), 4), scales, torch.zeros_like(scales), 64)
    words = tiles.tiles[0, 0]  # [32 lanes, 4 words]
    for g, t, j in [(0, 0, 0), (3, 2, 1), (7, 3, 3)]:
        w = int(words[4 * g + t, j]) & 0xFFFFFFFF
        nib = [(w >> (4 * i)) & 0xF for i in range(8)]
        col = 16 * j + 4 * t
        assert nib[0] == q[g, col] and nib[4] == q[g, col + 1]
        assert nib[2] == q[g, col + 2] and nib[6] == q[g, col + 3]
        assert nib[1] == q[g + 8, col] and nib[7] == q[g + 8, col + 3]


def test_unsupported_weights_are_declined():
    qweight, scales, zeros = make_weight(16, 128, 64, torch.bfloat16, 0)
    assert not qt.tiles_supported(qweight, scales, zeros + 0.5, 4, 64)  # not an integer
    assert not qt.tiles_supported(qweight, scales.float(), zeros.float(), 4, 64)
    q8 = ql.pack(torch.zeros(16, 128, dtype=torch.int32), 8)
    assert not qt.tiles_supported(q8, scales, zeros, 8, 64)
    q96, s96, z96 = make_weight(16, 96, 32, torch.bfloat16, 0)
    assert not qt.tiles_supported(q96, s96, z96, 4, 32)  # k not a multiple of 64
    q32, s32, z32 = make_weight(16, 128, 32, torch.bfloat16, 0)
    assert not qt.tiles_supported(q32, s32, z32, 4, 32)  # groups smaller than a tile
    q192, s192, z192 = make_weight(16, 384, 192, torch.bfloat16, 0)
    assert not qt.tiles_supported(q192, s192, z192, 4, 192)  # not a power of two
    assert qt.tiles_supported(q192, s192[:, :1], z192[:, :1], 4, 384)  # per channel


def test_cpu_linear_runs_the_reference():
    qweight, scales, zeros = make_weight(40, 128, 64, torch.bfloat16, 5)
    tiles = qt.repack(qweight, scales, zeros, 64)
    x = torch.randn(3, 128).to(torch.bfloat16)
    want = ql.quant_linear_ref(x, qweight, scales, zeros, 4, 64)
    assert torch.equal(qt.tile_linear(x, tiles), want)


# ---- GPU -----------------------------------------------------------------------------------------

def rel_err(out, ref):
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 12, 16, 17, 32, 33, 100, 300])
@pytest.mark.parametrize("n,k,group_size", [(7, 64, 64), (1001, 576, 64), (4104, 4096, 128),
                                            (96, 14336, 14336), (333, 4160, 64),
                                            (6144, 4096, 128), (4096, 14336, 128),
                                            (200, 1280, 256), (64, 1280, 1280),
                                            (16, 4096, 128)])  # one band: a CTA's group idle
def test_gemv_matches_reference(dtype, m, n, k, group_size):
    seed = m * 7919 + n * 31 + k
    qweight, scales, zeros = make_weight(n, k, group_size, dtype, seed, "cuda")
    tiles = qt.repack(qweight, scales, zeros, group_size)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype) if n % 2 else None
    out = qt.tile_linear(x, tiles, bias)
    ref = ql.quant_linear_ref(x.float(), qweight, scales.float(), zeros.float(), 4, group_size,
                              bias=None if bias is None else bias.float())
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < (3e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 4, 11, 16, 24, 40, 130])
@pytest.mark.parametrize("fusion", ["rms_norm", "silu_mul", "residual", "silu_mul_out",
                                    "rms_norm+silu_mul_out", "silu_mul_out_plain_layout"])
# k = 4096: the groups at fixed chunk positions; 9-16 rows there run two band groups a CTA, and
# n = 4224 (264 bands) gives the second group of each CTA a band of its own.
@pytest.mark.parametrize("k,n", [(1024, 1024), (4096, 1024), (4096, 4224)])
def test_fused_prologues_and_epilogues_match_reference(dtype, m, fusion, k, n):
    group_size = 128
    qweight, scales, zeros = make_weight(n, k, group_size, dtype, m + len(fusion) + k, "cuda")
    interleave = fusion.startswith("rms_norm+") or fusion == "silu_mul_out"
    tiles = qt.repack(qweight, scales, zeros, group_size, interleave)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 2 * k if fusion == "silu_mul" else k, generator=gen,
                    device="cuda").to(dtype)
    kwargs = {}
    if fusion.startswith("rms_norm"):
        kwargs.update(norm_weight=torch.randn(k, generator=gen, device="cuda").to(dtype),
                      eps=1e-5)
    if fusion == "silu_mul":
        kwargs["silu_mul"] = True
    if "silu_mul_out" in fusion:
        kwargs["silu_mul_out"] = True
    weight = ql.dequantize(qweight, scales, zeros, 4, group_size)
    if fusion == "residual":
        res = torch.randn(m, n, generator=gen, device="cuda").to(dtype)
        want = fused_linear_ref(x, weight, residual=res.clone())
        out = qt.tile_linear(x, tiles, residual=res)
        assert out.data_ptr() == res.data_ptr()
    else:
        want = fused_linear_ref(x, weight, **kwargs)
        out = qt.tile_linear(x, tiles, **kwargs)
    assert out.shape == want.shape
    assert rel_err(out, want) < (5e-3 if dtype == torch.float16 else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k", [256, 16384])
def test_rms_norm_over_warp_slices_of_any_length(m, k):
    """Each warp stages and normalises its own slice of x: at k = 256 some warps have no tiles
    (they add nothing to the row's sum of squares), at k = 16384 a lane's slice holds more norm
    weight vectors than it keeps in registers from before the PDL wait."""
    n, group_size, dtype = 64, 128, torch.bfloat16
    qweight, scales, zeros = make_weight(n, k, group_size, dtype, k + m, "cuda")
    tiles = qt.repack(qweight, scales, zeros, group_size)
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    norm = torch.randn(k, generator=gen, device="cuda").to(dtype)
    weight = ql.dequantize(qweight, scales, zeros, 4, group_size)
    want = fused_linear_ref(x, weight, norm_weight=norm, eps=1e-5)
    out = qt.tile_linear(x, tiles, norm_weight=norm, eps=1e-5)
    assert rel_err(out, want) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", [4096, 14336])
def test_one_launch_serves_the_rows_that_fit_and_refuses_more(k):
    """`rows_per_launch` rows of x go in one launch: 16 at both of Llama-3-8B's k on an H100 (two
    n-tiles over one read of the weight; at k = 14336 the launch splits k across CTAs). With the
    RMSNorm prologue k is not split, and one row more than fits the device's shared memory is
    refused with an error that says so, rather than launched."""
    n, dtype = 64, torch.bfloat16
    qweight, scales, zeros = make_weight(n, k, 128, dtype, 5, "cuda")
    tiles = qt.repack(qweight, scales, zeros, 128)
    rows, norm_rows = qt.rows_per_launch(tiles), qt.rows_per_launch(tiles, rms_norm=True)
    assert rows in (1, 2, 4, 8, 16) and norm_rows in (1, 2, 4, 8, 16) and norm_rows <= rows
    if torch.cuda.get_device_capability() == (9, 0):
        assert (rows, norm_rows) == {4096: (16, 16), 14336: (16, 4)}[k]
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
    out = torch.empty(rows, n, dtype=dtype, device="cuda")
    qt._launch(x, tiles, out, None, None, 1e-6, False, False, False)
    ref = ql.quant_linear_ref(x.float(), qweight, scales.float(), zeros.float(), 4, 128)
    assert rel_err(out, ref) < 1e-2
    if norm_rows < 16:
        norm = torch.randn(k, generator=gen, device="cuda").to(dtype)
        more = torch.randn(2 * norm_rows, k, device="cuda").to(dtype)
        with pytest.raises(ValueError, match=r"shared memory.*quant_tile_rows"):
            qt._launch(more, tiles, torch.empty(2 * norm_rows, n, dtype=dtype, device="cuda"),
                       None, norm, 1e-6, False, False, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hopper", [False, True])
def test_gemv_launches_per_call_then_the_gemm(hopper, monkeypatch):
    """Past one launch's rows, two GEMV launches serve the rest (each reading the weight), and
    the GEMM what is more; where the Hopper GEMM runs, it serves everything past one launch.
    Each path gives the reference's result; a Hopper GPU runs both."""
    if hopper and not runs_sm90a_code(torch.device("cuda")):
        pytest.skip("the wgmma GEMM runs where the sm_90a code does")
    monkeypatch.setattr(qt, "runs_sm90a_code", lambda device: hopper)
    n, k, dtype = 256, 1024, torch.bfloat16
    qweight, scales, zeros = make_weight(n, k, 128, dtype, 5, "cuda")
    tiles = qt.repack(qweight, scales, zeros, 128)
    rows = qt.rows_per_launch(tiles)
    gemv, gemm = [], []
    launch, tile_gemm = qt._launch, qt.tile_gemm
    monkeypatch.setattr(qt, "_launch", lambda *a, **kw: gemv.append(1) or launch(*a, **kw))
    monkeypatch.setattr(qt, "tile_gemm", lambda *a, **kw: gemm.append(1) or tile_gemm(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, launches in ((rows, (1, 0)), (rows + 1, (0, 1) if hopper else (2, 0)),
                        (2 * rows, (0, 1) if hopper else (2, 0)), (2 * rows + 1, (0, 1))):
        gemv.clear(), gemm.clear()
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        out = qt.tile_linear(x, tiles)
        ref = ql.quant_linear_ref(x.float(), qweight, scales.float(), zeros.float(), 4, 128)
        assert (len(gemv), len(gemm)) == launches, m
        assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [1, 2, 4, 7, 14])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("fusion", ["plain", "silu_mul+residual", "silu_mul_out", "bias"])
def test_k_split_across_ctas_matches_reference(splits, m, fusion):
    """k split across the CTAs of a band (down_proj's k = 14336 at 16 rows does not fit one CTA's
    shared memory): each split sums its slice, the band's last split adds them in split order
    and runs the epilogue. Every split count gives the reference, the same bits on every run,
    and leaves the workspace's counts at zero for the next launch."""
    dtype, group_size = torch.bfloat16, 128
    k = 14336 if fusion.startswith("silu_mul+") else 1792  # 1792: 28 tiles, groups straddle
    n = 1000 if fusion == "bias" else 512
    staged_rows = next(r for r in (1, 2, 4, 8, 16) if r >= m)
    if staged_rows * k // splits * 2 > 180_000:
        pytest.skip("the staged rows of one split do not fit an H100's shared memory")
    seed = splits * 101 + m * 7 + k
    qweight, scales, zeros = make_weight(n, k, group_size, dtype, seed, "cuda")
    tiles = qt.repack(qweight, scales, zeros, group_size, fusion == "silu_mul_out")
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(m, 2 * k if fusion.startswith("silu_mul+") else k, generator=gen,
                    device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype) if fusion == "bias" else None
    weight = ql.dequantize(qweight, scales, zeros, 4, group_size)
    kwargs = {"silu_mul_out": True} if fusion == "silu_mul_out" else {}
    if fusion.startswith("silu_mul+"):
        res = torch.randn(m, n, generator=gen, device="cuda").to(dtype)
        want = fused_linear_ref(x, weight, silu_mul=True, residual=res.clone())
        runs = []
        for _ in range(2):
            out = res.clone()
            qt._launch(x, tiles, out, None, None, 1e-6, True, True, False, splits=splits)
            runs.append(out)
    else:
        want = fused_linear_ref(x, weight, bias, **kwargs)
        runs = []
        for _ in range(2):
            out = torch.empty_like(want)
            qt._launch(x, tiles, out, bias, None, 1e-6, False, False,
                       fusion == "silu_mul_out", splits=splits)
            runs.append(out)
    assert rel_err(runs[0], want) < 2e-2
    assert torch.equal(runs[0], runs[1])
    assert not qt.split_workspace(x.device)[1].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_k_split_refuses_what_it_cannot_split():
    n, k, dtype = 64, 1024, torch.bfloat16
    qweight, scales, zeros = make_weight(n, k, 128, dtype, 3, "cuda")
    tiles = qt.repack(qweight, scales, zeros, 128)
    x = torch.randn(2, k, device="cuda").to(dtype)
    out = torch.empty(2, n, dtype=dtype, device="cuda")
    with pytest.raises(ValueError, match=r"splits=3 must be .* dividing k / 64=16"):
        qt._launch(x, tiles, out, None, None, 1e-6, False, False, False, splits=3)
    with pytest.raises(ValueError, match=r"rmsnorm needs the whole row.*splits=2"):
        qt._launch(x, tiles, out, None, torch.ones(k, dtype=dtype, device="cuda"), 1e-6, False,
                   False, False, splits=2)


@pytest.mark.parametrize("hopper", [False, True])
def test_gemm_plan_fills_one_wave(hopper, monkeypatch):
    """On Hopper, above 16 rows, the wgmma kernel (4 warpgroups: 256 weight rows a CTA) with k
    split as far as one wave of CTAs allows; elsewhere the mma.sync kernel (128 weight rows a
    CTA), split for about four CTAs an SM. Llama-3-8B's shapes on a 132-SM device."""
    monkeypatch.setattr(qt, "runs_sm90a_code", lambda device: hopper)
    monkeypatch.setattr(qt, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    plan = {(m, n, k): qt.gemm_plan(m, n, k, cpu) for m in (16, 32, 64, 128, 256)
            for n, k in ((6144, 4096), (28672, 4096), (4096, 14336))}
    if hopper:
        assert plan[(16, 6144, 4096)] == (32, 8, 1)  # 16 rows: the mma.sync kernel
        assert plan[(32, 6144, 4096)] == (64, 4, 4)
        assert plan[(64, 6144, 4096)] == (64, 4, 4)  # 24 CTAs: 96 in four slices of k
        assert plan[(64, 28672, 4096)] == (64, 1, 4)  # 112 CTAs: one wave unsplit
        assert plan[(64, 4096, 14336)] == (64, 8, 4)
        assert plan[(128, 6144, 4096)] == (128, 4, 4)
        assert plan[(256, 28672, 4096)] == (128, 1, 4)
        assert plan[(256, 4096, 14336)] == (128, 4, 4)
    else:
        assert plan[(64, 6144, 4096)] == (64, 8, 1)
        assert plan[(64, 28672, 4096)] == (64, 1, 1)
        assert plan[(128, 4096, 14336)] == (128, 8, 1)
        assert {p[2] for p in plan.values()} == {1}


def skip_without_kernel(kernel, block_rows):
    """Skips the GEMM test of the Hopper kernel (2 or 4 warpgroups) where it cannot run: off an
    sm_90a device and build, and at 32 rows a block."""
    if kernel > 1 and not (block_rows >= 64 and runs_sm90a_code(torch.device("cuda"))):
        pytest.skip("the wgmma GEMM runs where the sm_90a code does, at 64 or 128 rows a block")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [32, 64, 128])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_gemm_multiplies_the_exactly_dequantized_weight(dtype, block_rows, splits, interleave,
                                                        kernel):
    """The GEMM dequantizes each weight in registers exactly as `dequantize_tiles` does: rows of
    x that pick one column of k (x = e_c) give that column of the dequantized weight bit for bit,
    in any block of rows, any split of k and either row order (interleaved gate_up rows land in
    their logical columns), by the mma.sync kernel (1) and the Hopper one (2 or 4 warpgroups).
    Rows past a block's end, and past m, are not written; bands past n multiply nothing."""
    skip_without_kernel(kernel, block_rows)
    n, k, group_size, m = 96, 1024, 128, 70
    qweight, scales, zeros = make_weight(n, k, group_size, dtype, block_rows + splits, "cuda")
    tiles = qt.repack(qweight, scales, zeros, group_size, interleave)
    cols = torch.randperm(k, generator=torch.Generator().manual_seed(splits))[:m].cuda()
    x = torch.zeros(m, k, dtype=dtype, device="cuda")
    x[torch.arange(m, device="cuda"), cols] = 1
    out = qt.tile_gemm(x, tiles, block_rows=block_rows, splits=splits, kernel=kernel)
    weight = ql.dequantize(qweight, scales, zeros, 4, group_size)
    assert out.dtype == dtype and torch.equal(out, weight[:, cols].t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m,block_rows,splits", [(1, 32, 1), (31, 32, 5), (64, 64, 2),
                                                 (65, 64, 1), (200, 128, 9), (513, 128, 1)])
@pytest.mark.parametrize("group_size", [64, 128, 4096])
@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_gemm_matches_reference(m, block_rows, splits, group_size, kernel):
    """Random rows of x against F.linear over the dequantized weight in float32: the same
    products, summed in another order (split sums added in float32, then rounded once), with a
    bias and an x whose rows are strided."""
    skip_without_kernel(kernel, block_rows)
    n, k, dtype = 1040, 4096, torch.bfloat16
    qweight, scales, zeros = make_weight(n, k, group_size, dtype, m + group_size, "cuda")
    tiles = qt.repack(qweight, scales, zeros, group_size)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k + 64, generator=gen, device="cuda").to(dtype)[:, :k]
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    out = qt.tile_gemm(x, tiles, bias, block_rows=block_rows, splits=splits, kernel=kernel)
    ref = torch.nn.functional.linear(x.float(), qt.dequantize_tiles(tiles).float(), bias.float())
    assert out.shape == (m, n) and rel_err(out, ref) < 4e-3
    want = ref.to(dtype)  # one rounding of the exact-order sum: most elements agree bit for bit
    assert (out == want).float().mean().item() > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gemm_refuses_bad_launches():
    """Arguments the kernel cannot take are refused with the argument named, not launched."""
    qweight, scales, zeros = make_weight(64, 256, 64, torch.bfloat16, 3, "cuda")
    tiles = qt.repack(qweight, scales, zeros, 64)
    x = torch.randn(40, 256, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="block_rows=48"):
        qt.tile_gemm(x, tiles, block_rows=48)
    with pytest.raises(ValueError, match="splits=5 must be 1 to k / 64=4"):
        qt.tile_gemm(x, tiles, splits=5)
    with pytest.raises(ValueError, match=r"kernel=3 must be 1 \(mma.sync\) or 2 / 4"):
        qt.tile_gemm(x, tiles, kernel=3)
    with pytest.raises(ValueError, match="the wgmma kernel needs the sm_90a image"):
        qt.tile_gemm(x, tiles, block_rows=32, kernel=2)  # 32 rows: too few on any device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("interleave", [False, True])
def test_dequantize_kernel_is_exact(interleave):
    qweight, scales, zeros = make_weight(160, 256, 64, torch.bfloat16, 1, "cuda")
    tiles = qt.repack(qweight, scales, zeros, 64, interleave)
    assert torch.equal(qt.dequantize_tiles_cuda(tiles),
                       ql.dequantize(qweight, scales, zeros, 4, 64))
    assert torch.equal(qt.dequantize_tiles(tiles), ql.dequantize(qweight, scales, zeros, 4, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 2, 13])
def test_decoder_fused_path_matches_unfused_on_tiles(batch):
    """A decode step of a random W4A16 model: its projections in the tile layout (gate_up
    interleaved), the fused GEMVs (norms, SwiGLU, residual adds folded in) give the logits of the
    unfused path."""
    from tinyvllm.model.quantization import QuantLinear
    from tinyvllm.model.synthetic import make_random_quantized_model, tiny_arch
    from tests.ops.test_linear_cuda import fused_and_unfused_logits

    dtype = torch.bfloat16
    arch = tiny_arch(hidden_size=256, intermediate_size=640, num_heads=4, num_kv_heads=2,
                     head_dim=64, vocab_size=1000, num_layers=3)
    qt.split_workspace.cache_clear()
    model = make_random_quantized_model(arch, 3, dtype, torch.device("cuda"))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert layer.mlp.gate_up_proj.tiles is not None and layer.mlp.gate_up_proj.interleaved
    # the split-k scratch is made at load (before any graph capture), not by a first launch
    assert qt.split_workspace.cache_info().currsize >= 1
    fused, unfused = fused_and_unfused_logits(model, batch, dtype)
    assert rel_err(fused, unfused) <= 2e-2
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [40, 100])
def test_decoder_step_through_the_gemm_matches_dequantized_cublas(batch, monkeypatch):
    """A decode step of 33-128 rows of a random W4A16 model runs every projection through the
    tile GEMM (RMSNorm, SwiGLU and the residual adds as their own kernels around it, gate_up
    interleaved): its logits are those of the same step over the weights dequantized for
    cuBLAS, the path above the GEMM's rows."""
    from tinyvllm.model.synthetic import make_random_quantized_model, tiny_arch
    from tests.ops.test_linear_cuda import decode_step_logits

    dtype = torch.bfloat16
    arch = tiny_arch(hidden_size=256, intermediate_size=640, num_heads=4, num_kv_heads=2,
                     head_dim=64, vocab_size=1000, num_layers=3)
    model = make_random_quantized_model(arch, 4, dtype, torch.device("cuda"))
    launches = []
    gemm = qt.tile_gemm
    monkeypatch.setattr(qt, "tile_gemm", lambda *a, **kw: launches.append(1) or gemm(*a, **kw))
    through_gemm = decode_step_logits(model, batch, dtype)
    assert len(launches) == 4 * arch.num_layers  # qkv, o, gate_up, down of every layer
    monkeypatch.setattr(qt, "GEMM_MAX_ROWS", 0)
    monkeypatch.setattr(qt, "WGMMA_MAX_ROWS", 0)
    dequantized = decode_step_logits(model, batch, dtype)
    assert len(launches) == 4 * arch.num_layers
    assert rel_err(through_gemm, dequantized) <= 1e-2
    assert (through_gemm.argmax(-1) == dequantized.argmax(-1)).float().mean().item() >= 0.95
