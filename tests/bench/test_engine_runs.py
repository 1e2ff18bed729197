"""bench/engine_runs.run_batch: every request finishes, and the heap from before the run is
frozen only while it runs (the cyclic collector walks what the run makes, and a dropped engine
can still be collected after)."""

from __future__ import annotations

import gc

from tests.engine.conftest import make_engine
from tinyvllm.bench.engine_runs import run_batch


def test_the_heap_is_frozen_only_while_a_run_runs(tiny_model):
    engine = make_engine(tiny_model, num_kv_blocks=64)
    frozen_inside: list[int] = []
    run = run_batch(engine, [[1, 2, 3], [4, 5]], [4, 3],
                    sync=lambda: frozen_inside.append(gc.get_freeze_count()))
    assert [len(r.token_times_s) for r in run.requests] == [4, 3]
    assert frozen_inside and all(n > 0 for n in frozen_inside)
    assert gc.get_freeze_count() == 0
