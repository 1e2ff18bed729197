"""Tensor parallelism on the CPU: ranks in spawned processes (gloo) against one rank in the parent.

Each rank builds its part of the model, its own paged KV cache (its KV heads), prefills a few
prompts in one step and decodes greedily; every rank's logits must be the full vocabulary's, the
same on every rank, and match size 1's (float32).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.multiprocessing as mp

from tests.model.conftest import PagedRun
from tinyvllm.distributed import (TensorParallel, destroy_tensor_parallel, init_tensor_parallel,
                                  tp_broadcast)
from tinyvllm.model.arch import LlamaArch
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.synthetic import checkpoint_tensors, make_random_model, random_weights, tiny_arch
from tinyvllm.tokenization.synthetic import synthetic_tokenizer

SEED = 7
PROMPT_LENS = (5, 11, 17)  # ragged; 17 crosses a 16-token block
DECODE_STEPS = 4
ATOL_PER_LOGIT = 5e-6
"""Tolerance over the largest float32 logit: the ranks' partial sums add up in another order
than one rank's GEMM (measured: 2.5e-7 of it on the tiny models, 1.4e-6 on SmolLM2)."""
NEAR_TIE = 1e-4
SPAWN_TIMEOUT_S = 300  # only a hung collective comes near it

UNTIED = tiny_arch(vocab_size=509, attention_bias=True)  # vocab padded to 510; q/k/v biases
ONE_KV_HEAD = tiny_arch(num_heads=4, num_kv_heads=1, vocab_size=300, tie_word_embeddings=True)


@dataclasses.dataclass(frozen=True)
class Case:
    """A model every rank builds: random weights of `arch`, or the checkpoint at `path`."""

    arch: Optional[LlamaArch] = None
    path: Optional[str] = None
    fused: bool = False
    """Run every step through `forward_fused` (the CUDA decode path; torch references here)."""
    quantization: Optional[str] = None
    """`load_model`'s quantization (`--quantization`) for the checkpoint at `path`."""

    def build(self, tp: Optional[TensorParallel] = None) -> LlamaForCausalLM:
        from tinyvllm.model import load_model

        if self.arch is not None:
            model = make_random_model(self.arch, SEED, torch.float32, torch.device("cpu"), tp)
        else:  # packed=True as the CPU runner asks: more than one rank dequantizes instead
            model = load_model(self.path, torch.float32, torch.device("cpu"), packed=True,
                               quantization=self.quantization).model
        if self.fused:
            model.uses_fused_decode = lambda hidden: True
        return model


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    prompts[0][-1] = vocab_size - 1  # the last real row of the last rank's vocabulary slice
    return prompts


def _greedy(model: LlamaForCausalLM) -> torch.Tensor:
    """Prefill the prompts in one step, then decode greedily; -> each step's logits of each
    sequence's last token, [DECODE_STEPS, num_seqs, vocab_size]."""
    prompts = _prompts(model.arch.vocab_size)
    run = PagedRun(model, max(PROMPT_LENS) + DECODE_STEPS, len(prompts))
    last = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    steps = [run.step([(p, 0) for p in prompts])[last]]
    for i in range(DECODE_STEPS - 1):
        tokens = steps[-1].argmax(-1).tolist()
        steps.append(run.step([([t], len(p) + i) for p, t in zip(prompts, tokens)]))
    return torch.stack(steps)


def _rank_main(rank: int, size: int, init_method: str, cases: dict[str, Case],
               out_dir: str) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, size, backend="gloo", init_method=init_method)
    try:
        results = {"broadcast": tp_broadcast(torch.tensor([rank]), src=size - 1).item()}
        for name, case in cases.items():
            model = case.build()
            results[name] = {"logits": _greedy(model),
                             "num_heads": model.rank_arch.num_heads,
                             "num_kv_heads": model.rank_arch.num_kv_heads,
                             "kv_head_start": model.kv_head_start}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_tensor_parallel()


def _spawn(size: int, cases: dict[str, Case], out_dir: Path) -> list[dict]:
    """Run `cases` on `size` ranks; -> each rank's results."""
    args = (size, f"file://{out_dir / 'rendezvous'}", cases, str(out_dir))
    ranks = mp.spawn(_rank_main, args=args, nprocs=size, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"{size} tensor-parallel ranks did not finish in {SPAWN_TIMEOUT_S} s")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(size)]


def _assert_matches(name: str, ranks: list[dict], reference: torch.Tensor) -> None:
    """Every rank has rank 0's logits; rank 0's match size 1's step by step, greedy tokens too."""
    logits = ranks[0][name]["logits"]
    atol = ATOL_PER_LOGIT * float(reference.abs().max())
    for r, result in enumerate(ranks[1:], 1):
        assert torch.equal(result[name]["logits"], logits), f"{name}: rank {r} != rank 0"
    for step in range(DECODE_STEPS):
        torch.testing.assert_close(logits[step], reference[step], rtol=0, atol=atol,
                                   msg=lambda m: f"{name} step {step}: {m}")
        got, want = logits[step].argmax(-1), reference[step].argmax(-1)
        if not torch.equal(got, want):
            top2 = reference[step].topk(2).values
            gap = float((top2[:, 0] - top2[:, 1]).min())
            tie = f" (a near-tie: under {NEAR_TIE})" if gap < NEAR_TIE else ""
            pytest.fail(f"{name} step {step}: greedy tokens {got.tolist()} on {len(ranks)} "
                        f"ranks, {want.tolist()} on one; smallest top-2 gap {gap:.1e}{tie}")


def _write_hf_dir(directory: Path, arch: LlamaArch, tensors: dict[str, torch.Tensor]) -> str:
    """A safetensors checkpoint (HF-named `tensors` in two files, config.json, a tokenizer)."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n].contiguous() for n in part},
                  str(directory / f"model-{i}.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM" if arch.attention_bias else "LlamaForCausalLM"],
        "hidden_size": arch.hidden_size, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "num_hidden_layers": arch.num_layers, "intermediate_size": arch.intermediate_size,
        "vocab_size": arch.vocab_size, "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta, "tie_word_embeddings": arch.tie_word_embeddings,
        "max_position_embeddings": arch.max_position_embeddings,
        "eos_token_id": arch.vocab_size - 1}))
    synthetic_tokenizer(arch.vocab_size, "tp").backend.save(str(directory / "tokenizer.json"))
    return str(directory)


def _write_tiny_gguf(directory: Path) -> str:
    """test_loader_gguf's tiny llama GGUF: q/k rows permuted as llama.cpp stores them, tied."""
    from tests.model.test_loader_gguf import LLAMA3_SCALING, TOKENS, _write_gguf

    arch = tiny_arch(vocab_size=len(TOKENS), tie_word_embeddings=True, num_heads=6,
                     num_kv_heads=2, rope_scaling=LLAMA3_SCALING, max_position_embeddings=64)
    path = directory / "tiny.gguf"
    _write_gguf(path, make_random_model(arch, SEED, torch.float32, torch.device("cpu")))
    return str(path)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict[str, Case], list[dict]]:
    """The size-2 cases, run once on two ranks: (cases, each rank's results)."""
    weights = dict(random_weights(UNTIED, SEED, torch.float32, torch.device("cpu")))
    cases = {"untied-bias": Case(arch=UNTIED), "one-kv-head-tied": Case(arch=ONE_KV_HEAD),
             "fused-decode-path": Case(arch=UNTIED, fused=True),
             "safetensors": Case(path=_write_hf_dir(tmp_path_factory.mktemp("hf"), UNTIED,
                                                    weights)),
             "gguf": Case(path=_write_tiny_gguf(tmp_path_factory.mktemp("gguf")))}
    return cases, _spawn(2, cases, tmp_path_factory.mktemp("tp2"))


def _rank_heads(results: list[dict], name: str) -> list[tuple[int, int, int]]:
    """(query heads, KV heads, first KV head) of each rank."""
    return [(r[name]["num_heads"], r[name]["num_kv_heads"], r[name]["kv_head_start"])
            for r in results]


@pytest.mark.parametrize("name", ["untied-bias", "one-kv-head-tied", "fused-decode-path",
                                  "safetensors", "gguf"])
def test_two_ranks_match_one(name, two_ranks):
    cases, ranks = two_ranks
    model = dataclasses.replace(cases[name], fused=False).build(TensorParallel())
    _assert_matches(name, ranks, _greedy(model))
    heads, kv_heads = model.arch.num_heads // 2, model.arch.num_kv_heads
    # Two KV heads or more are split; one is replicated on both ranks.
    assert _rank_heads(ranks, name) == (
        [(heads, 1, 0), (heads, 1, 0)] if kv_heads == 1 else
        [(heads, kv_heads // 2, 0), (heads, kv_heads // 2, kv_heads // 2)])


def test_broadcast_reaches_every_rank(two_ranks):
    assert [r["broadcast"] for r in two_ranks[1]] == [1, 1]  # rank 1's value


def test_three_ranks_match_one_on_smollm2(smollm2_model, tmp_path):
    """SmolLM2-135M's weights (9 query heads, 3 KV heads: 3 and 1 per rank; tied embeddings),
    handed to the ranks as a safetensors checkpoint: each reads its slices only (every rank
    parsing the GGUF would cost far more than the test)."""
    model = smollm2_model.model
    tensors = {n: t for name, param in model.named_parameters()
               for n, t in checkpoint_tensors(name, param, model.arch)}
    path = _write_hf_dir(tmp_path, model.arch, tensors)
    ranks = _spawn(3, {"smollm2": Case(path=path)}, tmp_path)
    _assert_matches("smollm2", ranks, _greedy(model))
    assert _rank_heads(ranks, "smollm2") == [(3, 1, 0), (3, 1, 1), (3, 1, 2)]


@pytest.mark.parametrize("overrides,size,message", [
    ({}, 3, "num_attention_heads 4 is not divisible by it"),
    ({"num_heads": 6, "num_kv_heads": 3}, 2, "num_key_value_heads 3 neither"),
    ({"intermediate_size": 102}, 4, "intermediate_size 102 is not divisible"),
])
def test_sizes_that_do_not_split_the_model_are_refused(overrides, size, message):
    arch = tiny_arch(**overrides)
    with torch.device("meta"), pytest.raises(ValueError, match=f"tensor_parallel_size {size} "
                                             f"does not split the model: .*{message}"):
        LlamaForCausalLM(arch, TensorParallel(rank=0, size=size))
