"""tinyvllm.distributed in rank processes (gloo on the CPU): leaving the group frees its backend.

A gloo backend keeps worker threads; one that is still running when the interpreter tears down
takes the GIL to drop its last collective's tensors and aborts the process ("terminate called
without an active exception"). So once `destroy_tensor_parallel` has returned and the models
built on the group are gone, the group must be freed and its threads joined.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tinyvllm.distributed import destroy_tensor_parallel, get_tp, init_tensor_parallel, tp_broadcast
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.synthetic import tiny_arch

NUM_RANKS = 2
SPAWN_TIMEOUT_S = 120  # only a hung collective comes near it


def _thread_names() -> list[str]:
    return [Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            for tid in os.listdir("/proc/self/task")]


def _rank_main(rank: int, size: int, init_method: str, out_dir: str) -> None:
    init_tensor_parallel(rank, size, backend="gloo", init_method=init_method)
    tp_broadcast(torch.tensor([rank]), src=0)
    group = weakref.ref(get_tp().group)
    # What a rank does before its first step: build its part of a model (here on the meta
    # device, whose first op makes torch import more of torch.distributed), then drop it.
    with torch.device("meta"):
        LlamaForCausalLM(tiny_arch())
    destroy_tensor_parallel()
    result = {"group_freed": group() is None,
              "gloo_threads": sorted(n for n in _thread_names() if "gloo" in n)}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads in /proc")
def test_leaving_the_group_frees_the_backend_and_its_threads(tmp_path):
    ranks = mp.spawn(_rank_main, args=(NUM_RANKS, f"file://{tmp_path / 'rendezvous'}",
                                       str(tmp_path)), nprocs=NUM_RANKS, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ranks.join(timeout=1):  # raises if a rank failed or died of a signal
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"{NUM_RANKS} ranks did not finish in {SPAWN_TIMEOUT_S} s")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NUM_RANKS)]
    assert results == [{"group_freed": True, "gloo_threads": []}] * NUM_RANKS
