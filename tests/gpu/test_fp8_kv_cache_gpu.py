"""`kv_cache_dtype="fp8"` on CUDA, end to end, with the smollm2-135m-shape random-weight model
(no download): the model over an FP8 cache against a bf16 cache, the engine with CUDA graphs
against eager, scales updated after capture, and the block count under one memory budget.

Random weights give flat next-token distributions with many near-ties, so outputs are compared
by logprobs (vLLM's criterion for quantised caches), not token for token.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.engine.conftest import assert_all_blocks_free, run_to_completion
from tinyvllm import ops
from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import UniProcExecutor
from tinyvllm.model.synthetic import SMOLLM2_135M_SHAPE, make_random_model
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODEL = "smollm2-135m-shape"
FP8 = torch.float8_e4m3fn
BLOCK_SIZE = 16


def set_scales(model, k_scale: float, v_scale: float) -> None:
    for layer in model.model.layers:
        layer.self_attn.k_scale.fill_(k_scale)
        layer.self_attn.v_scale.fill_(v_scale)


class PagedSteps:
    """Three sequences over their own blocks of fresh caches (block 0 is the null block)."""

    def __init__(self, model, kv_dtype, max_seq_len: int = 96, num_seqs: int = 3) -> None:
        arch = model.arch
        per_seq = -(-max_seq_len // BLOCK_SIZE)
        self.model = model
        self.kv_caches = ops.allocate_kv_caches(arch.num_layers, 1 + num_seqs * per_seq,
                                                BLOCK_SIZE, arch.num_kv_heads, arch.head_dim,
                                                kv_dtype, torch.device("cuda"))
        self.tables = 1 + torch.arange(num_seqs * per_seq, dtype=torch.int32).view(num_seqs,
                                                                                   per_seq)

    @torch.inference_mode()
    def step(self, chunks: list[tuple[list[int], int]]) -> torch.Tensor:
        """chunks[i] = (new ids of sequence i, tokens already cached) -> [num_new, vocab]."""
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for i, (new_ids, start) in enumerate(chunks):
            for p in range(start, start + len(new_ids)):
                slots.append(int(self.tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
                positions.append(p)
            ids += new_ids
            cu.append(cu[-1] + len(new_ids))
            seq_lens.append(start + len(new_ids))
        dev = torch.device("cuda")
        meta = ops.AttentionMetadata(
            num_tokens=len(ids), slot_mapping=torch.tensor(slots, device=dev),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=self.tables[:len(chunks)].to(dev),
            max_query_len=max(len(c) for c, _ in chunks), max_seq_len=max(seq_lens),
            query_start_loc_cpu=cu, seq_lens_cpu=seq_lens)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                            self.kv_caches, meta)
        return self.model.compute_logits(hidden)


def run_steps(model, kv_dtype) -> torch.Tensor:
    """Logits of three sequences: prefills, a chunked prefill beside decodes, then 6 batched
    decode steps (the decode kernel with several partitions, the prefill kernel otherwise)."""
    run = PagedSteps(model, kv_dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.arch.vocab_size, (3, 90), generator=gen).tolist()
    logits = [run.step([(ids[0][:70], 0), (ids[1][:33], 0), (ids[2][:5], 0)]),
              run.step([(ids[0][70:71], 70), (ids[1][33:80], 33), (ids[2][5:6], 5)])]
    lengths = [71, 80, 6]
    for _ in range(6):
        logits.append(run.step([(ids[i][n:n + 1], n) for i, n in enumerate(lengths)]))
        lengths = [n + 1 for n in lengths]
    return torch.cat(logits)


@pytest.fixture(scope="module")
def model():
    return make_random_model(SMOLLM2_135M_SHAPE, seed=0, dtype=torch.bfloat16,
                             device=torch.device("cuda"))


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 0.125)])
def test_model_logits_over_fp8_cache_close_to_bf16(model, scales):
    expected = run_steps(model, torch.bfloat16)
    set_scales(model, *scales)
    try:
        got = run_steps(model, FP8)
    finally:
        set_scales(model, 1.0, 1.0)
    assert torch.isfinite(got).all()
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 0.1, f"relative logit error {rel:.3f}"  # 0.047 on the CPU reference path


def engine(**kwargs) -> EngineCore:
    kwargs.setdefault("num_kv_blocks", 512)
    config = EngineConfig.from_kwargs(model=MODEL, device="cuda", dtype="bfloat16",
                                      max_model_len=1024, **kwargs)
    return EngineCore(config, UniProcExecutor(config, ModelRunner(config)))


def generate(core: EngineCore, prompts: list[list[int]], max_tokens: int):
    """Greedy with top-5 logprobs; asserts that every KV block is free afterwards."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outputs = run_to_completion(core, prompts, params, field="new_logprobs")
    assert_all_blocks_free(core)
    return outputs


def assert_logprobs_close(ref, got, logprob_tol: float, near_tie: float) -> None:
    """Same tokens with logprobs within logprob_tol until the runs part, and they part only
    where ref's best and got's choice are within near_tie."""
    for r_seq, g_seq in zip(ref, got, strict=True):
        for r, g in zip(r_seq, g_seq, strict=True):
            if r.token_id == g.token_id:
                assert abs(r.logprob - g.logprob) <= logprob_tol
                continue
            alternatives = dict(zip(r.top_token_ids, r.top_logprobs))
            assert g.token_id in alternatives
            assert r.logprob - alternatives[g.token_id] <= near_tie
            break


def free_gpu_memory() -> None:
    """Collect dropped engines (they hold reference cycles) and return their memory."""
    gc.collect()
    torch.cuda.empty_cache()


def test_fp8_engine_graphs_match_eager_with_scales_set_after_capture():
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49000, (n,), generator=gen).tolist() for n in (5, 40, 17, 90)]
    results = []
    for eager in (True, False):
        core = engine(kv_cache_dtype="fp8", enforce_eager=eager, max_num_seqs=8)
        assert core.runner.kv_caches[0].dtype == FP8
        assert (core.runner.graphs is None) == eager
        set_scales(core.runner.model, 0.5, 0.25)  # after graph capture: read through pointers
        results.append(generate(core, prompts, 24))
        core.shutdown()
        core = None
        free_gpu_memory()
    assert_logprobs_close(results[0], results[1], logprob_tol=0.05, near_tie=0.1)


def test_fp8_doubles_the_blocks_of_a_bf16_cache_in_the_same_budget():
    """Profiled sizing: the KV memory is the same, FP8 blocks are half the bytes."""
    def sizing(kv: str) -> tuple[int, int]:
        core = engine(kv_cache_dtype=kv, num_kv_blocks=None, gpu_memory_utilization=0.8,
                      enforce_eager=True)
        result = core.runner.num_blocks, core.runner.kv_bytes_per_block()
        core.shutdown()
        return result

    blocks, block_bytes = {}, {}
    for kv in ("auto", "fp8"):
        free_gpu_memory()  # the previous engine's cache must be gone before the next profiles
        blocks[kv], block_bytes[kv] = sizing(kv)
    free_gpu_memory()
    assert block_bytes["auto"] == 2 * block_bytes["fp8"]
    assert 1.9 <= blocks["fp8"] / blocks["auto"] <= 2.1, blocks


def test_fp8_with_float32_on_cuda_raises_naming_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        config = EngineConfig.from_kwargs(model=MODEL, device="cuda", dtype="float32",
                                          kv_cache_dtype="fp8", num_kv_blocks=64,
                                          max_model_len=256)
        ModelRunner(config)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
def test_a_cache_of_another_16_or_32_bit_dtype_on_cuda_raises_before_the_load(kv_cache_dtype,
                                                                              monkeypatch):
    """The CUDA kernels read a cache of the queries' dtype: a bfloat16 model over a float16 or
    float32 cache is refused, naming the field, before any weight is loaded."""
    import tinyvllm.worker.model_runner as runner

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(runner, "load_model", no_load)
    with pytest.raises(ValueError, match=f"kv_cache_dtype: {kv_cache_dtype} on CUDA needs"):
        config = EngineConfig.from_kwargs(model=MODEL, device="cuda", dtype="bfloat16",
                                          kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64,
                                          max_model_len=256)
        ModelRunner(config)
