"""What every `tinyvllm bench` command shares: flags, the JSON record, timing, workloads, tables.

BENCHMARKS.md is the contract: ratios against a baseline measured in the same run, warm-up before
timing, medians (and p99 where latency matters), a JSON record that says what ran, a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from tinyvllm.bench.args import RESULTS_DIR
from tinyvllm.config import EngineConfig, engine_config_from_args

SPECIAL_TOKEN_MARGIN = 256
"""Random prompt ids start here, above the special and byte tokens at the start of a vocabulary."""


def prepare(args: argparse.Namespace) -> tuple[torch.device, Callable[[], None]]:
    """Set the thread count; return the device the engine will use and its synchronizer."""
    from tinyvllm.worker.model_runner import resolve_device

    from tinyvllm.ops.quantized import physical_cores

    # --threads (default: physical cores) for ours and the baseline alike.
    torch.set_num_threads(args.threads or physical_cores())
    device = resolve_device(args.device)
    return device, synchronizer(device)


def default_for(device: torch.device, gpu: Any, cpu: Any) -> Any:
    return gpu if device.type == "cuda" else cpu


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The engine config from the flags, with some fields replaced (e.g. prefix caching off)."""
    config = engine_config_from_args(args)
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for key, value in overrides.items():
        name = next(n for n, s in sections.items()
                    if key in {f.name for f in dataclasses.fields(s)})
        sections[name] = dataclasses.replace(sections[name], **{key: value})
    return EngineConfig(**sections)


# --- timing -------------------------------------------------------------------------------------

def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summary_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """Median, p99, mean, min and count of durations given in seconds, reported in ms."""
    ms = [1e3 * s for s in samples_s]
    return {"median_ms": statistics.median(ms), "p99_ms": percentile(ms, 99),
            "mean_ms": statistics.fmean(ms), "min_ms": min(ms), "count": len(ms)}


def copy_bandwidth_gbps(device: torch.device) -> Optional[float]:
    """Device-to-device copy bandwidth: (read + write) / time, measured as bench/kernels.py does."""
    if device.type != "cuda":
        return None
    from tinyvllm.bench.kernels import copy_bandwidth_gbps as measure
    gbps = measure()
    torch.cuda.empty_cache()
    return gbps


# --- workloads ----------------------------------------------------------------------------------

def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of random token ids (no tokenizer needed; identical for ours and the baseline)."""
    rng = np.random.default_rng(seed)
    high = max(vocab_size, SPECIAL_TOKEN_MARGIN + 1)
    return [rng.integers(SPECIAL_TOKEN_MARGIN, high, size=n).tolist() for n in lengths]


def lognormal_lengths(n: int, mean: int, seed: int, sigma: float = 0.5,
                      low: int = 4, high: Optional[int] = None) -> list[int]:
    """n lengths from a lognormal with the given mean (clipped to [low, high]), fixed seed."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma ** 2 / 2  # so that E[length] = mean
    lengths = np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), low, high or 8 * mean)
    return lengths.astype(int).tolist()


# --- the record ---------------------------------------------------------------------------------

def git_rev() -> str:
    if os.environ.get("TINYVLLM_GIT_REV"):
        return os.environ["TINYVLLM_GIT_REV"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {_cpu_model()} ({os.cpu_count()} cores)"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Who, where and what: the fields BENCHMARKS.md asks of every record."""
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {
        "git_rev": git_rev(), "device": device_name(device), "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers_version,
        "python": platform.python_version(), "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def model_fields(engine, config: EngineConfig) -> dict[str, Any]:
    """Model, dtype and quantization as the engine actually loaded them, and every engine flag."""
    info = engine.runtime_info
    runner = getattr(engine.executor, "runner", None)
    path = runner.loaded.path if runner is not None else config.model.model
    return {
        "model": config.model.model or "default (SmolLM2-135M-Instruct GGUF)",
        "model_name": info.model_name, "model_file": Path(str(path)).name if path else None,
        "dtype": info.dtype,
        "quantization": getattr(config.model, "quantization", None) or _weight_format(engine),
        "num_kv_blocks": info.num_kv_blocks,
        "engine_config": dataclasses.asdict(config),
    }


def _weight_format(engine) -> str:
    from tinyvllm.bench.engine_runs import is_packed

    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        return "unknown (worker processes)"
    name = Path(str(runner.loaded.path)).name
    if name.endswith(".gguf") and is_packed(engine):
        kernels = "GPU" if runner.device.type == "cuda" else "CPU"
        return f"GGUF {name.rsplit('.', 2)[-2]} blocks kept packed ({kernels} kernels)"
    if name.endswith(".gguf"):
        return f"none (GGUF {name.rsplit('.', 2)[-2]} dequantized at load)"
    return "none"


def model_label(record: dict[str, Any]) -> str:
    """"<model> <dtype>" for a table's title, with the weights' format unless they are plain
    floats ("llama3-8b-shape bfloat16, weights fp8")."""
    label = f"{record['model_name']} {record['dtype']}"
    quant = record.get("quantization")
    return label if quant is None or quant.startswith("none") else f"{label}, weights {quant}"


def write_record(name: str, record: dict[str, Any], out: Optional[str]) -> Path:
    path = Path(out or f"{RESULTS_DIR}/{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, **record}, indent=2, default=str))
    return path


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table: first column left-aligned, numbers right-aligned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                    for i, (h, w) in enumerate(zip(header, widths))))
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def ratio(ours: Optional[float], baseline: Optional[float]) -> Optional[float]:
    """ours / baseline, None when either is missing."""
    if ours is None or not baseline:
        return None
    return ours / baseline
