"""`tinyvllm serve --tensor-parallel-size 2`: the engine process starts its worker processes (one
per rank, gloo on the CPU) and streams the tokens one rank gives."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.client import AsyncClient
from tinyvllm.model.synthetic import random_weights, tiny_arch

from tests.model.test_tensor_parallel import _write_hf_dir
from tests.server.conftest import start_server

PROMPT = [5, 17, 99, 3, 250, 8, 8, 41]


@pytest.mark.slow
async def test_two_ranks_behind_the_server_stream_the_one_rank_tokens(tmp_path):
    from tinyvllm import LLM, SamplingParams

    arch = tiny_arch(vocab_size=512, num_heads=4, num_kv_heads=2)
    path = _write_hf_dir(tmp_path, arch, dict(random_weights(arch, 9, torch.float32,
                                                             torch.device("cpu"))))
    llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    server = start_server(tmp_path, "--model", path, "--device", "cpu", "--dtype", "float32",
                          "--tensor-parallel-size", "2")
    try:
        async with AsyncClient(server.target) as client:
            done = await client.complete(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert list(done.token_ids) == list(expected)
        assert done.finish_reason == "length"
    finally:
        server.stop()
    assert "worker rank" not in server.log()
