"""The contract between the CUDA wrappers (ops/*_cuda.py) and the bindings (cuda/bindings.cpp).

Every wrapper names each argument it passes; here each one runs on CPU tensors against a stand-in
module with the argument names of cuda/bindings.cpp, whose launchers record what they receive, so
a wrong, missing or extra name fails without a GPU. A built module, where one imports, must carry
the same names and the version this package expects.
"""

from __future__ import annotations

import enum
import importlib
import re
import types
from pathlib import Path

import pytest
import torch

from tinyvllm.ops import (_dispatch, attention_cuda, gguf_cuda, kv_cache, layers_cuda, linear,
                          quant_linear_cuda, quant_tiles, sampling_cuda, spec_decode_cuda,
                          w8a8_linear)
from tinyvllm.ops._dispatch import (CUDA_ABI_VERSION, KERNEL_FUNCTIONS, KERNEL_MIN_CAPABILITY,
                                    KernelSupport, module_problem)
from tinyvllm.ops.attention import AttentionMetadata, DecodePartitions

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
STREAM = 7  # the stream handle every launch must carry
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float8_e4m3fn": 3, "int8": 4}  # the stand-in's


def source_arg_names() -> dict[str, tuple[str, ...]]:
    """Launcher name -> argument names, as cuda/bindings.cpp declares them (def_launcher)."""
    source = (CUDA_DIR / "bindings.cpp").read_text()
    calls = re.findall(r'def_launcher\(m, "(\w+)", &tinyvllm::\w+,(.*?)\);', source, re.S)
    return {name: tuple(re.findall(r'"(\w+)"', names)) for name, names in calls}


class Launches(list):
    """(launcher name, {argument name: value}) of every launch, in order."""

    def only(self, name: str) -> dict:
        (args,) = [a for n, a in self if n == name]
        return args


@pytest.fixture
def launches(monkeypatch) -> Launches:
    """The wrappers' launches into a module with the source's names (a GPU that runs all)."""
    record = Launches()
    module = types.ModuleType("tinyvllm._cuda")
    module.abi_version = CUDA_ABI_VERSION
    module.DType = enum.IntEnum("DType", DTYPE_CODES)
    module.arg_names = source_arg_names()
    for name, params in module.arg_names.items():
        def launcher(*args, name=name, params=params):
            assert len(args) == len(params)
            record.append((name, dict(zip(params, args))))
        setattr(module, name, launcher)
    assert module_problem(module) is None  # the source defines every launcher an op calls
    kernels = _dispatch.keyword_module(module)
    support = KernelSupport((9, 0), frozenset(KERNEL_MIN_CAPABILITY), {})
    monkeypatch.setattr(_dispatch, "_cuda_module", lambda: kernels)
    monkeypatch.setattr(_dispatch, "device_support", lambda: support)
    for wrapper in (kv_cache, attention_cuda, layers_cuda, linear, sampling_cuda,
                    spec_decode_cuda, quant_linear_cuda, quant_tiles, gguf_cuda, w8a8_linear):
        monkeypatch.setattr(wrapper, "stream_handle", lambda device: STREAM)
    monkeypatch.setattr(attention_cuda, "sm_count", lambda device: 132)
    record.kernels = kernels
    return record


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def metadata(q_lens: list[int], seq_lens: list[int], block_size: int = 16) -> AttentionMetadata:
    """Sequences with consecutive blocks from 1 (block 0 is the null block)."""
    blocks = max(-(-s // block_size) for s in seq_lens)
    tables = 1 + torch.arange(len(seq_lens) * blocks, dtype=torch.int32).view(len(seq_lens), -1)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    slots = [int(tables[i, (s - q + j) // block_size]) * block_size + (s - q + j) % block_size
             for i, (q, s) in enumerate(zip(q_lens, seq_lens)) for j in range(q)]
    return AttentionMetadata(
        num_tokens=cu[-1], slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=cu,
        seq_lens_cpu=seq_lens)


def test_source_version_is_the_one_python_expects():
    source = (CUDA_DIR / "launchers.h").read_text()
    (version,) = re.findall(r"constexpr int kAbiVersion = (\d+);", source)
    assert int(version) == CUDA_ABI_VERSION


def test_kv_cache_write(launches):
    key, value = torch.randn(3, 2, 16).bfloat16(), torch.randn(3, 2, 16).bfloat16()
    cache = torch.zeros(2, 4, 16, 2, 16, dtype=torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)
    kv_cache._reshape_and_cache_cuda(launches.kernels, key, value, cache, torch.tensor([3, 9, 40]),
                                     k_scale, v_scale)
    args = launches.only("reshape_and_cache")
    assert (args["key"], args["value_cache"], args["k_scale"]) == (
        ptr(key), ptr(cache[1]), ptr(k_scale))
    assert (args["num_tokens"], args["num_kv_heads"], args["head_dim"], args["block_size"]) == (
        3, 2, 16, 16)
    assert (args["dtype"], args["cache_dtype"], args["stream"]) == (2, 3, STREAM)


def test_prefill_attention(launches):
    meta = metadata([3, 2], [3, 20])
    query = torch.randn(5, 4, 16, dtype=torch.float16)
    cache = torch.zeros(2, 5, 16, 2, 16, dtype=torch.float16)
    out = attention_cuda.paged_attention_cuda(launches.kernels, query, cache, meta, 0.25)
    args = launches.only("paged_attention")
    assert (args["out"], args["query_start_loc"], args["scale"]) == (
        ptr(out), ptr(meta.query_start_loc), 0.25)
    assert (args["num_seqs"], args["num_heads"], args["num_kv_heads"], args["max_query_len"],
            args["q_stride_token"], args["max_num_blocks_per_seq"]) == (2, 4, 2, 3, 64, 2)
    assert (args["k_scale"], args["dtype"], args["cache_dtype"], args["prefill_kernel"]) == (
        0, 1, 1, 0)
    launches.clear()
    attention_cuda.paged_attention_cuda(launches.kernels, query, cache, meta, 0.25,
                                        prefill_kernel="mma_sync")
    assert launches.only("paged_attention")["prefill_kernel"] == 1


def test_mixed_batch_sends_its_leading_decodes_to_the_decode_kernel(launches):
    meta = metadata([1, 1, 5, 1], [40, 300, 5, 9])  # two decodes, a prefill, a decode after it
    assert meta.leading_decodes == (2, 300)
    query = torch.randn(8, 4, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 40, 16, 2, 16, dtype=torch.bfloat16)
    out = attention_cuda.paged_attention_cuda(launches.kernels, query, cache, meta, 0.25)
    assert [name for name, _ in launches] == ["paged_attention_decode", "paged_attention"]
    decode, prefill = launches[0][1], launches[1][1]
    assert (decode["num_seqs"], decode["query"], decode["out"], decode["seq_lens"]) == (
        2, ptr(query), ptr(out), ptr(meta.seq_lens))
    row = meta.block_tables.stride(0) * 4
    assert (prefill["num_seqs"], prefill["query"], prefill["out"]) == (2, ptr(query), ptr(out))
    assert (prefill["seq_lens"], prefill["query_start_loc"], prefill["block_tables"]) == (
        ptr(meta.seq_lens) + 8, ptr(meta.query_start_loc) + 8, ptr(meta.block_tables) + 2 * row)
    assert prefill["max_num_blocks_per_seq"] == meta.block_tables.shape[1]
    launches.clear()
    attention_cuda.paged_attention_cuda(launches.kernels, query, cache, meta, 0.25,
                                        split_decodes=False)
    assert [name for name, _ in launches] == ["paged_attention"]
    assert launches[0][1]["num_seqs"] == 4


@pytest.mark.parametrize("batch,tier,want", [
    (1, 1024, (64, 16, 1)), (1, 4096, (256, 16, 1)), (8, 1024, (512, 2, 1)),
    (16, 1024, (512, 2, 1)), (32, 1024, (512, 2, 1)), (64, 1024, (512, 2, 4)),
    (256, 2048, (512, 4, 4))])
def test_decode_partition_takes_a_cta_per_query_head_while_the_launch_is_small(batch, tier, want):
    """Llama-3-8B's 32 / 8 heads on 132 multiprocessors: a CTA per query head while that makes
    at most 16 a multiprocessor, its partitions chosen for those CTAs; else 4 heads a CTA."""
    assert attention_cuda.decode_partition(batch, 32, 8, tier, 132) == want


def test_batch_invariant_decode_partitions_follow_the_context(launches):
    """Under batch_invariant every decode launch splits into 64-token partitions (at least 2, so
    every row is merged alike), whatever the batch: here 64 sequences of 300 tokens, which
    otherwise take 256-token partitions at a CTA per query head (enough CTAs without finer
    ones)."""
    from tinyvllm import ops
    from tinyvllm.config import KernelConfig
    meta = metadata([1] * 64, [300] * 64)
    query = torch.randn(64, 4, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 1300, 16, 2, 16, dtype=torch.bfloat16)
    attention_cuda.paged_attention_cuda(launches.kernels, query, cache, meta, 0.25)
    args = launches.only("paged_attention_decode")
    assert (args["partition_size"], args["heads_per_cta"]) == (256, 1)
    ops.configure(KernelConfig(batch_invariant=True))
    try:
        for lens in ([300] * 64, [40]):
            launches.clear()
            meta = metadata([1] * len(lens), lens)
            attention_cuda.paged_attention_cuda(launches.kernels, query[:len(lens)], cache, meta,
                                                0.25)
            args = launches.only("paged_attention_decode")
            assert (args["partition_size"], args["num_splits"]) == (64, max(2, -(-lens[0] // 64)))
    finally:
        ops.configure(KernelConfig())


def test_fused_decode_attention_with_partitions_merged_by_o_proj(launches):
    meta = metadata([1], [300])  # one sequence, 2 KV heads: split into 5 partitions of 64
    qkv = torch.randn(1, (4 + 2 * 2) * 16).bfloat16()
    q, k, v = qkv.split([64, 32, 32], dim=-1)
    cache = torch.zeros(2, 20, 16, 2, 16, dtype=torch.bfloat16)
    cos_sin = torch.zeros(512, 16)
    parts = attention_cuda.rotary_paged_attention_cuda(
        launches.kernels, torch.tensor([299]), q, k, v, cos_sin, cache, meta, 0.25, merge=False)
    assert isinstance(parts, DecodePartitions) and parts.partition_size == 64
    args = launches.only("paged_attention_decode")
    assert (args["new_key"], args["new_value"], args["new_kv_stride"], args["cos_sin_cache"],
            args["slot_mapping"]) == (ptr(k), ptr(v), 128, ptr(cos_sin), ptr(meta.slot_mapping))
    assert (args["split_out"], args["num_splits"], args["partition_size"],
            args["merge_splits"]) == (ptr(parts.out), 5, 64, 0)

    merged = parts.merge()
    args = launches.only("paged_decode_merge")
    assert (args["out"], args["split_sum"], args["num_splits"], args["dtype"]) == (
        ptr(merged), ptr(parts.sum), 5, 2)

    weight, residual = torch.randn(24, 64).bfloat16(), torch.randn(1, 24).bfloat16()
    assert linear.fused_linear(parts, weight, residual=residual) is residual
    args = launches.only("gemv_merge")
    assert (args["weight"], args["residual"], args["bias"], args["split_max"]) == (
        ptr(weight), ptr(residual), 0, ptr(parts.max))
    assert (args["m"], args["n"], args["num_heads"], args["head_dim"], args["out_stride"]) == (
        1, 24, 4, 16, 24)


def test_layers(launches):
    x, weight = torch.randn(3, 32).half(), torch.randn(32).half()
    residual = torch.randn(3, 32).half()
    layers_cuda.rms_norm_cuda(launches.kernels, x, weight, 1e-5, residual)
    args = launches.only("rms_norm")
    assert (args["residual"], args["hidden"], args["eps"], args["dtype"]) == (
        ptr(residual), 32, 1e-5, 1)
    out = layers_cuda.silu_and_mul_cuda(launches.kernels, x)
    assert launches.only("silu_and_mul")["out"] == ptr(out)
    assert launches.only("silu_and_mul")["d"] == 16

    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16).half()
    q, k, v = qkv.split([64, 32, 32], dim=-1)
    positions, cos_sin = torch.tensor([0, 1, 2]), torch.zeros(8, 16)
    layers_cuda.rotary_embedding_cuda(launches.kernels, positions, q, k, cos_sin, 16)
    args = launches.only("rotary_embedding")
    assert (args["num_heads"], args["num_kv_heads"], args["query_stride"]) == (4, 2, 128)
    cache = torch.zeros(2, 2, 16, 2, 16, dtype=torch.half)
    layers_cuda.rotary_embedding_and_cache_cuda(launches.kernels, positions, q, k, v, cos_sin, 16,
                                                cache, torch.tensor([0, 1, 2]))
    args = launches.only("rotary_embedding_and_cache")
    assert (args["value"], args["key_cache"], args["value_stride"], args["cache_dtype"]) == (
        ptr(v), ptr(cache[0]), 128, 1)


def test_fused_linear(launches):
    x, weight = torch.randn(2, 64).bfloat16(), torch.randn(48, 32).bfloat16()
    norm_weight = torch.randn(32).bfloat16()
    out = linear._fused_linear_cuda(x, weight, None, None, 1e-6, True, None, None, True, False,
                                    0)
    args = launches.only("gemv")
    assert (args["out"], args["x"], args["norm_weight"]) == (ptr(out), ptr(x), 0)
    assert (args["m"], args["n"], args["k"], args["x_stride"], args["out_stride"]) == (
        2, 48, 32, 64, 24)
    assert (args["prologue"], args["silu_mul_out"], args["prefetch_weight"], args["mma"]) == (
        2, 1, 0, 0)
    launches.clear()
    linear._fused_linear_cuda(x[:1, :32], weight, None, norm_weight, 1e-6, False, None, None,
                              False, True, 0)
    args = launches.only("gemv")
    assert (args["norm_weight"], args["prologue"], args["prefetch_weight"]) == (
        ptr(norm_weight), 1, 1)
    launches.clear()
    x5, w64 = torch.randn(5, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    linear._fused_linear_cuda(x5, w64, None, None, 1e-6, False, None, None, False, False, 1)
    args = launches.only("gemv")
    assert (args["m"], args["n"], args["k"], args["mma"]) == (5, 48, 64, 1)



def test_batch_invariant_fused_linear_is_one_launch_of_row_chunks(launches):
    """Under batch_invariant a step of any size is one launch of the tensor-core GEMV in row
    chunks (`mma` 2), which sizes them to its staging; 0, 1 stay the decode kernels."""
    from tinyvllm import ops
    from tinyvllm.config import KernelConfig
    x, weight = torch.randn(37, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    residual = torch.randn(37, 48).bfloat16()
    ops.configure(KernelConfig(batch_invariant=True))
    try:
        assert linear._gemv_kernel(37, _Cuda(x), weight) == linear.INVARIANT_CHUNKS
        assert linear._gemv_kernel(1, _Cuda(torch.randn(1, 96).bfloat16()),
                                   torch.randn(48, 96).bfloat16()) is None  # k % 64
        got = linear._fused_linear_cuda(x, weight, None, None, 1e-6, False, residual, None,
                                        False, False, linear.INVARIANT_CHUNKS)
    finally:
        ops.configure(KernelConfig())
    args = launches.only("gemv")
    assert got is residual
    assert (args["m"], args["mma"], args["x"], args["residual"], args["out"]) == (
        37, 2, ptr(x), ptr(residual), ptr(residual))


class _Cuda:
    """A CPU tensor that says it is on CUDA (for the kernel choice only)."""

    is_cuda = True

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype = t.shape, t.dtype


def test_batch_invariant_attention_runs_every_token_as_a_decode_row(launches, monkeypatch):
    """Under batch_invariant a mixed step (a decode, a verification-sized chunk and a prompt)
    runs no prefill kernel: each new token is a decode row with its sequence's block table and
    the context up to itself, in launches whose partitions fit _INVARIANT_SPLIT_BYTES."""
    from tinyvllm import ops
    from tinyvllm.config import KernelConfig
    meta = metadata([1, 5, 3], [40, 200, 3])
    query = torch.randn(9, 4, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 60, 16, 2, 16, dtype=torch.bfloat16)
    rows = meta.decode_rows
    assert rows.seq_lens_cpu == [40, 196, 197, 198, 199, 200, 1, 2, 3]
    assert rows.seq_lens.tolist() == rows.seq_lens_cpu and rows.is_pure_decode
    assert torch.equal(rows.block_tables, meta.block_tables[[0, 1, 1, 1, 1, 1, 2, 2, 2]])
    assert meta.decode_rows is rows and rows.decode_rows is rows  # built once per step
    ops.configure(KernelConfig(batch_invariant=True))
    try:
        out = attention_cuda.paged_attention_cuda(launches.kernels, query, cache, meta, 0.25)
        assert [name for name, _ in launches] == ["paged_attention_decode"]
        args = launches[0][1]
        assert (args["num_seqs"], args["seq_lens"], args["block_tables"]) == (
            9, ptr(rows.seq_lens), ptr(rows.block_tables))
        assert (args["partition_size"], args["num_splits"], args["merge_splits"]) == (64, 4, 1)
        # Rows in groups: 4 heads x 4 splits x (16 + 2) floats = 1,152 bytes a row.
        monkeypatch.setattr(attention_cuda, "_INVARIANT_SPLIT_BYTES", 4 * 1152)
        launches.clear()
        attention_cuda.paged_attention_cuda(launches.kernels, query, cache, meta, 0.25, out=out)
        groups = [a for _, a in launches]
        assert [a["num_seqs"] for a in groups] == [4, 4, 1]
        row_q, row_table = query.stride(0) * 2, rows.block_tables.stride(0) * 4
        assert [a["query"] - ptr(query) for a in groups] == [0, 4 * row_q, 8 * row_q]
        assert [a["out"] - ptr(out) for a in groups] == [0, 4 * 128, 8 * 128]
        assert [a["block_tables"] - ptr(rows.block_tables) for a in groups] == [
            0, 4 * row_table, 8 * row_table]
        assert [a["seq_lens"] - ptr(rows.seq_lens) for a in groups] == [0, 16, 32]
    finally:
        ops.configure(KernelConfig())

def test_sampling(launches):
    logits, temperature = torch.randn(2, 100), torch.tensor([0.0, 0.7])
    seed = torch.tensor([1, 2])
    tokens = sampling_cuda.sample_cuda(launches.kernels, logits, temperature, None,
                                       torch.tensor([0.9, 1.0]), None, seed, seed, None)
    args = launches.only("sample")
    assert (args["out"], args["logits"], args["temperature"], args["top_k"]) == (
        ptr(tokens), ptr(logits), ptr(temperature), 0)
    assert (args["num_rows"], args["vocab_size"], args["noise"], args["noise_stride"]) == (
        2, 100, 0, 0)

    probs = torch.rand(5, 100)
    drafts, cu = torch.tensor([4, 5, 6]), torch.tensor([0, 3])
    spec_decode_cuda.rejection_sample_cuda(launches.kernels, probs[:4], drafts, cu, None, None,
                                           None, seed[:1], seed[:1])
    args = launches.only("rejection_sample")
    assert (args["out_stride"], args["draft_token_ids"], args["draft_probs"], args["num_reqs"],
            args["vocab_size"]) == (4, ptr(drafts), 0, 1, 100)


def test_quantized_linear(launches):
    x = torch.randn(3, 128).bfloat16()
    qweight = torch.zeros(48, 16, dtype=torch.int32)  # n = 48, k = 128 at 4 bits
    scales, bias = torch.ones(48, 1).bfloat16(), torch.zeros(48).bfloat16()
    zeros = scales.clone()
    out = quant_linear_cuda.quant_linear_cuda(launches.kernels, x, qweight, scales, zeros, 4, 128,
                                              bias=bias, method="mma")
    args = launches.only("quant_gemv")
    assert (args["out"], args["x"], args["qweight"], args["scales"], args["zeros"],
            args["bias"]) == (ptr(out), ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias))
    assert (args["m"], args["n"], args["k"], args["x_stride"], args["out_stride"], args["bits"],
            args["group_size"], args["method"], args["dtype"]) == (3, 48, 128, 128, 48, 4, 128, 2,
                                                                   2)
    launches.clear()
    weight = quant_linear_cuda.quant_dequantize_cuda(launches.kernels, qweight, scales, zeros, 4,
                                                     128)
    args = launches.only("quant_dequantize")
    assert (args["out"], args["qweight"], args["n"], args["k"], args["bits"]) == (
        ptr(weight), ptr(qweight), 48, 128, 4)


def test_quantized_tiles(launches):
    qweight = torch.zeros(48, 16, dtype=torch.int32)  # n = 48, k = 128 at 4 bits
    scales = torch.ones(48, 2).bfloat16()
    tiles = quant_tiles.repack(qweight, scales, scales.clone(), 64, interleave=True)
    x, norm = torch.randn(2, 128).bfloat16(), torch.ones(128).bfloat16()
    out = torch.empty(2, 24).bfloat16()
    quant_tiles._launch(x, tiles, out, None, norm, 1e-5, False, False, True)
    args = launches.only("quant_tile_gemv")
    assert (args["out"], args["x"], args["tiles"], args["tile_scales"], args["bias"],
            args["residual"], args["norm_weight"]) == (ptr(out), ptr(x), ptr(tiles.tiles),
                                                       ptr(tiles.tile_scales), 0, 0, ptr(norm))
    assert (args["m"], args["n"], args["k"], args["x_stride"], args["out_stride"],
            args["residual_stride"], args["group_size"], args["interleaved"], args["prologue"],
            args["silu_mul_out"], args["dtype"], args["stream"]) == (
        2, 48, 128, 128, 24, 24, 64, 1, 1, 1, 2, STREAM)
    sums, counts = quant_tiles.split_workspace(x.device)  # k split across CTAs: their scratch
    assert (args["splits"], args["split_sums"], args["split_sums_len"], args["split_counts"],
            args["split_counts_len"]) == (0, ptr(sums), quant_tiles.SPLIT_SUMS, ptr(counts),
                                          quant_tiles.SPLIT_COUNTS)
    assert not counts.any()
    launches.clear()
    quant_tiles._launch(x, tiles, out, None, None, 1e-5, False, False, True, splits=2)
    assert launches.only("quant_tile_gemv")["splits"] == 2
    for rms_norm in (False, True):
        launches.clear()
        quant_tiles._rows_per_launch.cache_clear()
        quant_tiles.rows_per_launch(tiles, rms_norm)
        quant_tiles._rows_per_launch.cache_clear()
        assert launches.only("quant_tile_rows") == {"k": 128, "rms_norm": int(rms_norm)}
    launches.clear()
    weight = quant_tiles.dequantize_tiles_cuda(tiles)
    args = launches.only("quant_tile_dequantize")
    assert (args["out"], args["tiles"], args["tile_scales"], args["n"], args["k"],
            args["group_size"], args["interleaved"], args["dtype"]) == (
        ptr(weight), ptr(tiles.tiles), ptr(tiles.tile_scales), 48, 128, 64, 1, 2)


def test_gguf_linear(launches):
    x = torch.randn(2, 64).half()
    qweight = torch.zeros(8, 36, dtype=torch.uint8)  # Q4_0: two 18-byte blocks per row
    out = gguf_cuda.gguf_linear_cuda(launches.kernels, x, qweight, 2, 64)
    args = launches.only("gguf_gemv")
    assert (args["out"], args["x"], args["qweight"], args["bias"]) == (ptr(out), ptr(x),
                                                                       ptr(qweight), 0)
    assert (args["m"], args["n"], args["k"], args["x_stride"], args["qtype"], args["dtype"]) == (
        2, 8, 64, 64, 2, 1)
    assert (args["residual"], args["norm_weight"], args["prologue"], args["silu_mul_out"]) == (
        0, 0, 0, 0)
    launches.clear()
    norm = torch.randn(64).half()
    out = gguf_cuda.gguf_linear_cuda(launches.kernels, x, qweight, 2, 64, norm_weight=norm,
                                     eps=1e-5, silu_mul_out=True)
    args = launches.only("gguf_gemv")
    assert out.shape == (2, 4) and (args["out"], args["norm_weight"], args["prologue"]) == (
        ptr(out), ptr(norm), 1)
    assert (args["silu_mul_out"], args["residual"], args["out_stride"], args["eps"]) == (
        1, 0, 4, 1e-5)
    launches.clear()
    wide = torch.zeros(2, 24).half()
    residual = wide[:, :8]  # the residual stream's rows, a stride of 24 apart
    assert gguf_cuda.gguf_linear_cuda(launches.kernels, x, qweight, 2, 64,
                                      residual=residual) is residual
    args = launches.only("gguf_gemv")
    assert (args["out"], args["residual"], args["out_stride"], args["residual_stride"]) == (
        ptr(residual), ptr(residual), 24, 24)
    assert args["prologue"] == 0 and args["silu_mul_out"] == 0
    launches.clear()
    with pytest.raises(ValueError, match=r"x: expected \[..., 64\]"):  # silu_mul's 2k columns
        gguf_cuda.gguf_linear_cuda(launches.kernels, torch.randn(2, 128).half(), qweight, 2, 64,
                                   residual=residual)
    with pytest.raises(ValueError, match=r"norm_weight: expected .*\(64,\)"):
        gguf_cuda.gguf_linear_cuda(launches.kernels, x, qweight, 2, 64, norm_weight=norm[:32])
    with pytest.raises(ValueError, match=r"residual: expected .*\(2, 8\)"):
        gguf_cuda.gguf_linear_cuda(launches.kernels, x, qweight, 2, 64, residual=wide[:, :9])
    assert not launches
    rows = gguf_cuda.gguf_dequantize_cuda(launches.kernels, qweight, 2, 64, torch.bfloat16,
                                          torch.tensor([3, 1]))
    args = launches.only("gguf_dequantize")
    assert (args["out"], args["num_rows"], args["k"], args["qtype"], args["dtype"]) == (
        ptr(rows), 2, 64, 2, 2)


def test_w8a8_activation_quantization_and_int8_epilogue(launches):
    x = torch.randn(40, 64).bfloat16()[3:6, :48]  # a row stride of 64
    scale = torch.tensor(0.5)
    q, scales = w8a8_linear._quantize_rows_cuda(launches.kernels, x, torch.float8_e4m3fn, scale,
                                                448.0)
    args = launches.only("quantize_rows")
    assert (args["out"], args["scales"], args["x"]) == (ptr(q), ptr(scales), ptr(x))
    assert args["static_scale"] != 0 and q.dtype == torch.float8_e4m3fn and scales.shape == (3, 1)
    assert (args["num_tokens"], args["k"], args["x_stride"], args["out_stride"], args["qmax"],
            args["dtype"], args["qdtype"], args["stream"]) == (3, 48, 64, 48, 448.0, 2, 3, STREAM)
    launches.clear()
    w8a8_linear._quantize_rows_cuda(launches.kernels, x, torch.int8, None, 127.5)
    args = launches.only("quantize_rows")
    assert (args["static_scale"], args["qmax"], args["scale_divisor"], args["min_absmax"],
            args["qdtype"]) == (0, 127.0, 127.5, w8a8_linear.MIN_ABSMAX, 4)
    launches.clear()
    acc = torch.zeros(20, 16, dtype=torch.int32)[:3]
    x_scale, w_scale, bias = torch.ones(3, 1), torch.ones(16), torch.zeros(16).half()
    out = w8a8_linear._rescale_int32_cuda(launches.kernels, acc, x_scale, w_scale, bias,
                                          torch.float16)
    args = launches.only("rescale_int32")
    assert (args["out"], args["acc"], args["x_scale"], args["w_scale"], args["bias"]) == (
        ptr(out), ptr(acc), ptr(x_scale), ptr(w_scale), ptr(bias))
    assert (args["m"], args["n"], args["acc_stride"], args["out_stride"], args["dtype"]) == (
        3, 16, 16, 16, 1)


def test_w8a8_activation_quantization_fused_into_norm_and_swiglu(launches):
    x, weight = torch.randn(40, 64).half()[3:6, :48], torch.randn(48).half()  # row stride 64
    residual, scale = torch.randn(3, 48).half(), torch.tensor(0.25)
    rows, res = layers_cuda.rms_norm_quant_cuda(launches.kernels, x, weight, 1e-5, residual,
                                                torch.int8, 127.5)
    args = launches.only("rms_norm_quant")
    assert res is residual and rows.dtype == torch.float16
    assert rows.q.dtype == torch.int8 and rows.q.shape == (3, 48) and rows.scales.shape == (3, 1)
    assert (args["out"], args["scales"], args["x"], args["residual"], args["weight"],
            args["static_scale"]) == (ptr(rows.q), ptr(rows.scales), ptr(x), ptr(residual),
                                      ptr(weight), 0)
    assert (args["num_tokens"], args["hidden"], args["x_stride"], args["residual_stride"],
            args["out_stride"], args["eps"]) == (3, 48, 64, 48, 48, 1e-5)
    assert (args["qmax"], args["scale_divisor"], args["min_absmax"], args["dtype"],
            args["qdtype"], args["stream"]) == (127.0, 127.5, w8a8_linear.MIN_ABSMAX, 1, 4,
                                                STREAM)
    launches.clear()
    layers_cuda.rms_norm_quant_cuda(launches.kernels, x, weight, 1e-5, None,
                                    torch.float8_e4m3fn, 448.0, scale)
    args = launches.only("rms_norm_quant")
    assert (args["residual"], args["residual_stride"], args["qmax"], args["qdtype"]) == (
        0, 0, 448.0, 3)
    assert args["static_scale"] != 0
    launches.clear()
    gate_up = torch.randn(5, 80).bfloat16()[:3, :64]  # d = 32, row stride 80
    rows = layers_cuda.silu_and_mul_quant_cuda(launches.kernels, gate_up, torch.float8_e4m3fn,
                                               448.0, scale)
    args = launches.only("silu_and_mul_quant")
    assert rows.q.shape == (3, 32) and rows.dtype == torch.bfloat16
    assert (args["out"], args["scales"], args["x"]) == (ptr(rows.q), ptr(rows.scales),
                                                        ptr(gate_up))
    assert args["static_scale"] != 0
    assert (args["num_tokens"], args["d"], args["x_stride"], args["out_stride"], args["qmax"],
            args["scale_divisor"], args["dtype"], args["qdtype"], args["stream"]) == (
        3, 32, 80, 32, 448.0, 448.0, 2, 3, STREAM)


def test_every_launcher_is_exercised_above():
    tested = set(re.findall(r'launches\.only\("(\w+)"\)', Path(__file__).read_text()))
    assert tested == {f for functions in KERNEL_FUNCTIONS.values() for f in functions}


def test_the_built_module_matches_its_sources():
    try:
        module = importlib.import_module("tinyvllm._cuda")
    except ImportError:
        pytest.skip("tinyvllm._cuda is not built")
    assert module_problem(module) is None
    assert {name: tuple(names) for name, names in module.arg_names.items()} == source_arg_names()
    assert {name: int(code) for name, code in module.DType.__members__.items()} == DTYPE_CODES
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in DTYPE_CODES)
