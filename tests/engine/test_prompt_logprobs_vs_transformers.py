"""Prompt logprobs of the engine equal log_softmax of transformers' logits on the same SmolLM2
weights (both float32 on the CPU), across chunk boundaries and with prefix caching on."""

from __future__ import annotations

import pytest

from tinyvllm.sampling_params import SamplingParams
from tinyvllm.scheduling.request import EngineCoreRequest

from ..conftest import hf_prompt_logprobs
from .conftest import assert_all_blocks_free, make_engine

pytestmark = pytest.mark.slow

TOL = 1e-4  # nats; measured differences are ~1e-5
TEXT = ("The river carried boats past the old mill, and the miller counted them twice before "
        "writing the number in his ledger. ") * 2


def run_alone(engine, request_id: str, ids: list[int], params: SamplingParams) -> list:
    """One request to completion; its prompt logprobs in prompt order."""
    engine.add_request(EngineCoreRequest(request_id, ids, params))
    lps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lps += out.new_prompt_logprobs or []
    return lps


def test_prompt_logprobs_match_transformers_across_chunks_and_cached_prefixes(smollm2,
                                                                              smollm2_hf):
    ids = smollm2.tokenizer.encode(TEXT)
    assert len(ids) > 2 * 16, "the prompt must span several chunks"
    expected = hf_prompt_logprobs(smollm2_hf, ids)
    engine = make_engine(smollm2, max_num_batched_tokens=16, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    for request_id in ("first", "again"):  # the second would hit the first's cached blocks
        lps = run_alone(engine, request_id, ids, params)
        assert lps[0] is None and len(lps) == len(ids)
        assert [lp.token_id for lp in lps[1:]] == ids[1:]
        for lp, e in zip(lps[1:], expected.tolist()):
            assert lp.logprob == pytest.approx(e, abs=TOL)
            assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0] >= lp.logprob - TOL
    assert engine.get_stats().prefix_cache_hits == 0
    assert_all_blocks_free(engine)
