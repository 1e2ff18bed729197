"""GGUF blocks kept packed on a GPU (`--no-dequantize`): the CUDA block GEMV serves the
projections and the embedding, and the model scores a prompt as the dequantized model does."""

from __future__ import annotations

import gguf
import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.model.packed import PackedEmbedding, PackedLinear, PackedShards
from tinyvllm.model.synthetic import make_random_model, tiny_arch
from tinyvllm.ops import quantized as q
from tests.model.test_loader_gguf import LLAMA3_SCALING, TOKENS, _write_gguf
from tests.model.test_packed import MIXED_TYPE_BY_TENSOR, _kquant_gguf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = "The capital of France is Paris and the capital of Italy is Rome"


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q8_0", "Q4_K_M"])
def quantized_gguf(request, tmp_path_factory):
    if request.param == "Q4_K_M":  # Q4_K q / k beside a Q6_K v, Q5_K o / down, Q6_K gate / up
        return _kquant_gguf(tmp_path_factory, MIXED_TYPE_BY_TENSOR, "tiny-q4_k_m.gguf")
    # head_dim 64: the CUDA attention kernels serve 64 and 128.
    arch = tiny_arch(vocab_size=len(TOKENS), tie_word_embeddings=True, hidden_size=128,
                     num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=256,
                     rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                     max_position_embeddings=64)
    model = make_random_model(arch, 5, torch.float32, torch.device("cpu"))
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    _write_gguf(path, model, qtype=gguf.GGMLQuantizationType[request.param])
    return path


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    return torch.tensor([entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_on_gpu_scores_as_the_dequantized_model(quantized_gguf, dtype):
    kwargs = dict(model=str(quantized_gguf), device="cuda", dtype=dtype, num_kv_blocks=32,
                  enforce_eager=False)
    packed = LLM(dequantize=False, **kwargs)
    net = packed.engine.runner.model
    assert isinstance(net.model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(net.model.embed_tokens, PackedEmbedding)
    assert net.model.layers[0].mlp.down_proj.qweight.is_cuda
    if "q4_k_m" in quantized_gguf.name:
        qkv = net.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, PackedShards)
        assert [p.qtype for p in qkv.parts] == [q.KQUANT_TYPES[t] for t in ("Q4_K", "Q4_K", "Q6_K")]
        assert net.model.embed_tokens.qtype == q.KQUANT_TYPES["Q4_K"]
    got = _prompt_logprobs(packed)
    del packed
    ref = _prompt_logprobs(LLM(dequantize=True, **kwargs))
    # Both use the same dequantized values; the float path rounds them to 16 bits first.
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_packed_decode_step_runs_fused_as_the_unfused_layers(quantized_gguf, batch):
    """A decode step over packed weights takes `forward_fused` (the GGUF GEMV with the RMSNorm,
    SwiGLU and residual add folded in; PackedShards with them apart) and gives the logits of the
    separate ops."""
    from tests.ops.test_linear_cuda import REL_TOL, fused_and_unfused_logits, rel_err

    llm = LLM(model=str(quantized_gguf), device="cuda", dtype="bfloat16", num_kv_blocks=32,
              dequantize=False)
    model = llm.engine.runner.model
    fused, unfused = fused_and_unfused_logits(model, batch, torch.bfloat16)
    assert rel_err(fused, unfused) <= REL_TOL[torch.bfloat16]
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))
