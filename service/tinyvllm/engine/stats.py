"""`EngineStats`: the engine's numbers after each step, as they travel to the frontend.

One struct end to end: `EngineCore.get_stats()` builds it, the engine process sends it in every
`StepOutputs` (msgspec), and the frontend hands the same object to the metrics collector and the
periodic stats log line. It imports only msgspec, so the frontend reads it without the engine.
"""

from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct, array_like=True, frozen=True):
    """A snapshot for metrics; counters are cumulative since start. `EngineStats()` (all zero)
    stands for the engine before its first report."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0  # usable blocks (the null block excluded)
    num_free_kv_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0  # in the last step (0 when the message reports no step)
    # Speculative decoding (cumulative): verification steps, draft tokens proposed and accepted,
    # and accepted draft tokens by position in the draft (index 0: the first draft token).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_per_position: list[int] = []
