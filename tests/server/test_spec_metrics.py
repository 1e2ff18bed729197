"""A server with n-gram speculation: /metrics exposes the speculative-decoding counters (vLLM's
names, `tinyvllm:` prefix) and they move when a quoting prompt is served."""

from __future__ import annotations

import pytest

from tinyvllm.client import AsyncClient

from .conftest import start_server, wait_for_metrics

SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'
PROMPT = ("Repeat exactly: the quick brown fox jumps over the lazy dog; the quick brown fox "
          "jumps over the lazy dog; the quick brown fox")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("spec"), "--speculative-config", SPEC)
    yield srv
    srv.stop()


@pytest.mark.slow
async def test_speculative_counters_move(spec_server):
    async with AsyncClient(spec_server.target) as client:
        r = await client.complete(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
    assert r.usage.completion_tokens == 24
    m = wait_for_metrics(spec_server, {"tinyvllm:num_requests_running": 0})
    drafts = m["tinyvllm:spec_decode_num_draft_tokens_total"]
    accepted = m["tinyvllm:spec_decode_num_accepted_tokens_total"]
    assert m["tinyvllm:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    per_pos = {k: v for k, v in m.items()
               if k.startswith("tinyvllm:spec_decode_num_accepted_tokens_per_pos_total")}
    assert per_pos["tinyvllm:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    assert sum(per_pos.values()) == accepted
