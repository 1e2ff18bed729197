"""The decoder over the paged cache: chunking and batching must not change the numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyvllm.model.synthetic import LLAMA3_8B_SHAPE, make_random_model, tiny_arch

PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 7, 199, 12, 13, 77, 2, 90, 61, 33, 34, 35, 36],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 100, 200, 150, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def model():
    return make_random_model(tiny_arch(num_heads=6, num_kv_heads=2), seed=0,
                             dtype=torch.float32, device=torch.device("cpu"))


def test_chunked_prefill_and_decode_match_full_prefill(model, paged_run):
    ids = PROMPTS[0]
    full = paged_run(model, len(ids)).step([(ids, 0)])
    run = paged_run(model, len(ids))
    pieces = [run.step([(ids[:7], 0)]), run.step([(ids[7:18], 7)])]
    pieces += [run.step([([ids[i]], i)]) for i in range(18, len(ids))]  # decode steps
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-5, rtol=1e-5)


def test_mixed_batch_matches_sequences_alone(model, paged_run):
    alone = [paged_run(model, len(p)).step([(p, 0)]) for p in PROMPTS]
    run = paged_run(model, max(map(len, PROMPTS)), num_seqs=2)
    first = run.step([(PROMPTS[0][:19], 0), (PROMPTS[1][:5], 0)])  # prefill + prefill
    second = run.step([(PROMPTS[0][19:], 19), (PROMPTS[1][5:], 5)])  # decode + chunked prefill
    torch.testing.assert_close(first[:19], alone[0][:19], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first[19:], alone[1][:5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[:1], alone[0][19:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[1:], alone[1][5:], atol=1e-5, rtol=1e-5)
    decode = run.step([([3], 20), ([4], len(PROMPTS[1]))])  # batched pure decode
    assert decode.shape == (2, model.arch.vocab_size) and decode.dtype == torch.float32


def test_random_model_is_seeded():
    arch = tiny_arch()
    a, b, c = (make_random_model(arch, seed, torch.float32, torch.device("cpu"))
               for seed in (1, 1, 2))
    assert torch.equal(a.model.layers[1].self_attn.qkv_proj.weight,
                       b.model.layers[1].self_attn.qkv_proj.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert abs(a.model.embed_tokens.weight.std().item() - 0.02) < 0.002
    assert (a.model.norm - 1).abs().max() <= 0.05


def test_bfloat16_keeps_float32_rotary_table(paged_run):
    arch = tiny_arch(tie_word_embeddings=True)
    model = make_random_model(arch, 0, torch.bfloat16, torch.device("cpu"))
    assert model.cos_sin_cache.dtype == torch.float32
    assert model.lm_head is None and model.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = paged_run(model, 8).step([(list(range(8)), 0)])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    model.to(torch.float32)
    assert torch.equal(model.cos_sin_cache, make_random_model(
        arch, 0, torch.float32, torch.device("cpu")).cos_sin_cache)


def test_llama3_8b_shape_has_8b_parameters():
    a = LLAMA3_8B_SHAPE
    per_layer = (a.hidden_size * (a.q_size + 2 * a.kv_size) + a.q_size * a.hidden_size
                 + 3 * a.hidden_size * a.intermediate_size + 2 * a.hidden_size)
    total = a.num_layers * per_layer + 2 * a.vocab_size * a.hidden_size + a.hidden_size
    assert total == 8_030_261_248
    assert dataclasses.replace(a, num_layers=1).rope_scaling["factor"] == 8.0


def test_unfused_rotary_and_cache_write_give_the_same_logits(model, paged_run):
    """KernelConfig(fused_rotary_cache=False): rotary, cache write and attention as separate ops
    compute what the fused op does (prefill, then decode)."""
    from tinyvllm import ops
    from tinyvllm.config import KernelConfig

    def run() -> torch.Tensor:
        ids, seq = PROMPTS[1], paged_run(model, len(PROMPTS[1]))
        return torch.cat([seq.step([(ids[:-2], 0)]), seq.step([([ids[-2]], len(ids) - 2)]),
                          seq.step([([ids[-1]], len(ids) - 1)])])

    fused = run()
    try:
        ops.configure(KernelConfig(fused_rotary_cache=False))
        unfused = run()
    finally:
        ops.configure(KernelConfig())
    assert torch.equal(unfused, fused)
