"""CPU-only comparisons for `bench latency` / `bench throughput`, measured in the same run.

* `stream_read_gbps`: a streaming-read bandwidth (sum over a buffer far larger than the caches, all
  `threads`), the ceiling a decode step's weight reads are set against.
* `LlamaCpp`: llama.cpp on the same GGUF file through `llama-cpp-python`, when installed (the
  column is left out otherwise). It builds from its source distribution, about 20 minutes on two
  cores: `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

STREAM_BYTES = 256 << 20
"""Large against any L3, so that the read comes from DRAM."""
STREAM_REPEATS = 5


def stream_read_gbps() -> float:
    """Best of a few torch.sum passes over STREAM_BYTES of float32: bytes read / second."""
    buf = torch.ones(STREAM_BYTES // 4, dtype=torch.float32)
    buf.sum()  # first touch
    best = float("inf")
    for _ in range(STREAM_REPEATS):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return STREAM_BYTES / best / 1e9


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class LlamaCpp:
    """llama.cpp through llama-cpp-python on one GGUF file, greedy, every token forced."""

    llm: Any
    threads: int

    @classmethod
    def load(cls, path: Path, threads: int, context_len: int) -> Optional["LlamaCpp"]:
        if not llama_cpp_available() or path.suffix != ".gguf":
            return None
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(path), n_ctx=context_len, n_threads=threads,
                              n_threads_batch=threads, n_batch=512, verbose=False)
        return cls(llm, threads)

    def describe(self) -> dict[str, Any]:
        import llama_cpp
        return {"name": "llama.cpp (llama-cpp-python)", "version": llama_cpp.__version__,
                "threads": self.threads}

    def time_single(self, prompt: Sequence[int], num_new_tokens: int) -> list[float]:
        """Seconds from the call to each generated token (greedy; EOS does not stop it)."""
        times: list[float] = []
        start = time.perf_counter()
        for _ in self.llm.generate(list(prompt), top_k=1, top_p=1.0, temp=0.0, reset=True):
            times.append(time.perf_counter() - start)
            if len(times) == num_new_tokens:
                break
        return times
