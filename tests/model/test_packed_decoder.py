"""The fused CPU step (model/packed_decoder.py, core_cpp/cpu/decoder.cpp) against the module path
over the same packed weights: several sequences, prefill, chunked prefill and decode rows mixed in
one step, awkward shapes (blocks per row not a multiple of the GEMV tile, GQA and MHA, a qkv
bias), each instruction set this machine runs and 1-3 threads.

Both paths quantize the same activations to int8 per 32 values; they differ only in float
summation order (RMSNorm, attention), which now and then moves a value across an int8 rounding
boundary. A crossing moves a projection's output by at most one quantization step of one input,
so the bound is relative: ATOL_OF_MAX of the largest logit (seen: 1.6e-3 where a crossing
happens, a Q4_0 case; under 1e-6 elsewhere). Most values agree far closer, which the median
check states."""

from __future__ import annotations

import gguf
import pytest
import torch

from tinyvllm.model.packed import PackedLinear, PackedShards
from tinyvllm.model.packed_decoder import PackedDecoder
from tinyvllm.model.synthetic import make_random_model, tiny_arch
from tinyvllm.ops import quantized as q
from tests.model.conftest import PagedRun

_cpu = pytest.importorskip("tinyvllm._cpu")

ISAS = ["scalar"] + [isa for isa in ("avx2", "avx512vnni") if q.isa_available(isa)]
ATOL_OF_MAX = 5e-3
MEDIAN_OF_MAX = 1e-6
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

ARCHS = {
    # hidden 96 = 3 blocks: every GEMV ends in a partial 4-row tile of blocks; GQA 6:2; qkv bias
    "gqa-bias": tiny_arch(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=2,
                          head_dim=16, intermediate_size=160, attention_bias=True),
    # MHA, head_dim 32, one KV head per query head; 130 qkv rows: not a multiple of 4
    "mha": tiny_arch(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                     intermediate_size=96),
}


def _packed_model(arch, qtype: int, seed: int):
    """A random Llama whose four projections per layer are PackedLinear over gguf's quantization
    of the random weights (embedding and head stay float)."""
    net = make_random_model(arch, seed, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for layer in net.model.layers:
        for path in PROJECTIONS:
            parent, name = path.rsplit(".", 1)
            old = layer.get_submodule(path)
            w = old.weight.numpy()
            qweight = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
            bias = None if old.bias is None else torch.randn(old.bias.shape, generator=gen) * 0.1
            setattr(layer.get_submodule(parent), name,
                    PackedLinear(qweight, qtype, old.in_features, bias=bias))
    net.packed_decoder = PackedDecoder.for_model(net)
    assert net.packed_decoder is not None
    return net


# Three sequences: two prompts, then a step mixing two decode rows with a third prompt's first
# chunk, then its second chunk beside two more decode rows, then three decode rows.
STEPS = [
    [(list(range(3, 20)), 0), (list(range(40, 45)), 0)],
    [([7], 17), ([8], 5), (list(range(60, 71)), 0)],
    [([9], 18), ([10], 6), (list(range(71, 90)), 11)],
    [([11], 19), ([12], 7), ([13], 30)],
]


def _run(net, fused: bool, kv_dtype: torch.dtype = torch.float32
         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    decoder = net.packed_decoder
    net.packed_decoder = decoder if fused else None
    try:
        run = PagedRun(net, 48, num_seqs=3, kv_dtype=kv_dtype)
        logits = [run.step(chunks[:3]) for chunks in STEPS]
    finally:
        net.packed_decoder = decoder
    return logits, run.kv_caches


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    err = (got - want).abs()
    assert err.max().item() <= ATOL_OF_MAX * scale, f"max err {err.max().item():.3g} of {scale:.3g}"
    assert err.median().item() <= MEDIAN_OF_MAX * scale


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("arch_name", sorted(ARCHS))
def test_fused_step_matches_the_module_path(arch_name, type_name, isa, threads, monkeypatch):
    monkeypatch.setenv("TINYVLLM_CPU_ISA", isa)
    net = _packed_model(ARCHS[arch_name], q.KERNEL_TYPES[type_name], seed=len(arch_name))
    _assert_fused_matches_the_module_path(net, threads)


def _assert_fused_matches_the_module_path(net, threads: int) -> None:
    q.set_num_threads(threads)
    try:
        fused, fused_caches = _run(net, fused=True)
    finally:
        q.set_num_threads(None)
    ref, ref_caches = _run(net, fused=False)
    for got, want in zip(fused, ref):
        assert got.shape == want.shape and not bool(got.isnan().any())
        _assert_close(got, want)
    for got, want in zip(fused_caches, ref_caches):  # the same slots written, and only those
        assert torch.equal(got == 0, want == 0)
        _assert_close(got, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_fused_step_over_a_float16_cache_matches_the_module_path(type_name, isa, monkeypatch):
    """The fused step writes K/V as half (rounded as torch rounds) and reads them widened: the
    module path over a float16 cache (torch's writes, the C++ attention) gives the same."""
    monkeypatch.setenv("TINYVLLM_CPU_ISA", isa)
    net = _packed_model(ARCHS["gqa-bias"], q.KERNEL_TYPES[type_name], seed=5)
    q.set_num_threads(2)
    try:
        fused, fused_caches = _run(net, fused=True, kv_dtype=torch.float16)
    finally:
        q.set_num_threads(None)
    ref, ref_caches = _run(net, fused=False, kv_dtype=torch.float16)
    assert all(c.dtype == torch.float16 for c in fused_caches + ref_caches)
    assert net.packed_decoder.serves(torch.zeros(1, ARCHS["gqa-bias"].hidden_size), fused_caches)
    for got, want in zip(fused, ref):
        assert not bool(got.isnan().any())
        _assert_close(got, want)
    for got, want in zip(fused_caches, ref_caches):
        assert torch.equal(got == 0, want == 0)
        _assert_close(got.float(), want.float())


@pytest.mark.skipif("avx512vnni" not in ISAS, reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_avx512_step_equals_the_avx2_step(type_name, kv_dtype, monkeypatch):
    """The 512-bit tiles follow the block dot contract and the 512-bit quantize_row and SwiGLU
    the 256-bit arithmetic, and the K-quant dots are exact integers: the whole fused step gives
    the same bits on either."""
    net = (_kquant_model(type_name, seed=9) if type_name in q.KQUANT_TYPES
           else _packed_model(ARCHS["gqa-bias"], q.KERNEL_TYPES[type_name], seed=9))
    runs = {}
    for isa in ("avx2", "avx512vnni"):
        monkeypatch.setenv("TINYVLLM_CPU_ISA", isa)
        runs[isa] = _run(net, fused=True, kv_dtype=kv_dtype)
    (logits, caches), (logits512, caches512) = runs["avx2"], runs["avx512vnni"]
    assert all(torch.equal(a, b) for a, b in zip(logits, logits512))
    assert all(torch.equal(a, b) for a, b in zip(caches, caches512))


KQUANT_ARCH = tiny_arch(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                        intermediate_size=512)
"""Every projection's k a multiple of 256 (hidden, q_size, intermediate), as the K-quants need."""


def _kquant_model(type_name: str, seed: int):
    """KQUANT_ARCH with random K-quant blocks of one type as its four projections per layer."""
    net = make_random_model(KQUANT_ARCH, seed, torch.float32, torch.device("cpu"))
    qtype = q.KQUANT_TYPES[type_name]
    for i, layer in enumerate(net.model.layers):
        for j, path in enumerate(PROJECTIONS):
            parent, name = path.rsplit(".", 1)
            old = layer.get_submodule(path)
            rows = q.random_kquant_rows(old.out_features, old.in_features, qtype,
                                        seed=seed + 10 * i + j)
            setattr(layer.get_submodule(parent), name, PackedLinear(rows, qtype, old.in_features))
    net.packed_decoder = PackedDecoder.for_model(net)
    assert net.packed_decoder is not None
    return net


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", sorted(q.KQUANT_TYPES))
def test_fused_step_over_kquants_matches_the_module_path(type_name, isa, threads, monkeypatch):
    """The K-quant projections run the same kernel in both paths (activations int8 per 256
    values); the rest differs in float summation order as for the 32-value types."""
    monkeypatch.setenv("TINYVLLM_CPU_ISA", isa)
    _assert_fused_matches_the_module_path(_kquant_model(type_name, seed=11), threads)


def _sharded_model(seed: int):
    """ARCHS["gqa-bias"] with every qkv as PackedShards of Q4_1 q and k rows and Q8_0 v rows, and
    every gate_up as Q4_0 gate rows beside Q4_1 up rows (the shards' outputs land in columns of
    a wider row: the GEMM's out_stride)."""
    arch = ARCHS["gqa-bias"]
    net = _packed_model(arch, q.KERNEL_TYPES["Q4_1"], seed)
    ref = make_random_model(arch, seed, torch.float32, torch.device("cpu"))
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    splits = {"self_attn.qkv_proj": [(q_rows, "Q4_1"), (kv_rows, "Q4_1"), (kv_rows, "Q8_0")],
              "mlp.gate_up_proj": [(arch.intermediate_size, "Q4_0"),
                                   (arch.intermediate_size, "Q4_1")]}
    for layer, ref_layer in zip(net.model.layers, ref.model.layers):
        for path, shards in splits.items():
            parent, name = path.rsplit(".", 1)
            old = layer.get_submodule(path)
            weight, parts, first = ref_layer.get_submodule(path).weight.numpy(), [], 0
            for rows, type_name in shards:
                qtype = q.KERNEL_TYPES[type_name]
                qweight = gguf.quants.quantize(weight[first:first + rows],
                                               gguf.GGMLQuantizationType(qtype))
                parts.append(PackedLinear(torch.from_numpy(qweight), qtype, old.in_features))
                first += rows
            setattr(layer.get_submodule(parent), name, PackedShards(parts, bias=old.bias))
    net.packed_decoder = PackedDecoder.for_model(net)
    assert net.packed_decoder is not None
    return net


@pytest.mark.parametrize("isa", ISAS)
def test_fused_step_over_shards_of_mixed_types_matches_the_module_path(isa, monkeypatch):
    """Stacks of mixed 32-value types (the GEMM writing each shard's columns of the wider qkv and
    gate_up rows, qkv's bias split with them) against the module path's PackedShards."""
    monkeypatch.setenv("TINYVLLM_CPU_ISA", isa)
    _assert_fused_matches_the_module_path(_sharded_model(seed=13), threads=2)


def test_projections_that_do_not_fit_the_shape_are_refused():
    """The kernel names what does not fit before it runs (the Python side never builds such a
    step): a K-quant projection whose k is not a multiple of 256, shards whose rows do not add
    up to the projection's."""
    net = _kquant_model("Q4_K", seed=12)
    dims = net.packed_decoder.dims[:]
    net.packed_decoder.dims = [320, *dims[1:]]  # hidden: qkv's and gate_up's k
    with pytest.raises(ValueError, match="k: expected a positive multiple of 256 for K-quant"):
        _run(net, fused=True)
    net.packed_decoder.dims = [*dims[:4], 320]  # intermediate: gate_up's 1024 rows are too many
    with pytest.raises(ValueError, match="gate_up: shards of 1024 rows in all, expected 640"):
        _run(net, fused=True)


def test_the_dequantized_model_has_no_fused_step(tiny_model):
    assert PackedDecoder.for_model(tiny_model.model) is None  # nn.Linear projections


def test_bad_block_ids_raise_before_anything_is_written():
    net = _packed_model(ARCHS["mha"], q.KERNEL_TYPES["Q4_1"], seed=1)
    run = PagedRun(net, 32)
    run.block_tables[0, 0] = 10_000
    before = [c.clone() for c in run.kv_caches]
    with pytest.raises(IndexError, match="block id 10000 outside the cache's"):
        run.step([([1, 2, 3], 0)])
    assert all(torch.equal(a, b) for a, b in zip(before, run.kv_caches))
