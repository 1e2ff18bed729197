"""The Hugging Face transformers baseline: `generate` on the same prompts and the same weights.

* GGUF file (the default SmolLM2): transformers' own GGUF loader dequantizes the same file.
* Hugging Face directory: `from_pretrained` on the same directory.
* Anything else (a synthetic model such as `llama3-8b-shape`): a `LlamaForCausalLM` built from
  the same architecture with random weights. Timing with every token forced equals a real
  checkpoint's; the text is noise.

Greedy, `min_new_tokens == max_new_tokens` so both sides produce the same number of tokens, in
the engine's dtype and on its device. On GPU the decode uses a static KV cache
(`cache_implementation="static"`, which transformers compiles unless --no-baseline-compile) for
equal-shaped batches, the strongest setting a user would pick.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tinyvllm.engine.engine_core import EngineCore

CPU_WARMUP_TOKENS = 8
"""Without a static cache nothing is compiled, so a short generate warms the CPU baseline up."""


@dataclass
class HFBaseline:
    model: Any
    device: torch.device
    source: str  # how the weights were obtained, for the record
    pad_token_id: int
    eos_token_ids: list[int]
    compile: bool

    @property
    def static_cache(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> dict[str, Any]:
        import transformers
        return {"name": "transformers.generate", "version": transformers.__version__,
                "weights": self.source, "dtype": str(self.model.dtype).removeprefix("torch."),
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "static_cache": self.static_cache, "compile": self.compile and self.static_cache}


@dataclass(frozen=True)
class ModelSpec:
    """What the baseline needs to know about the engine's model, kept after the engine is gone
    (on a GPU both do not fit in memory at once)."""

    path: Path
    name: str
    arch: Any  # LlamaArch
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, engine: EngineCore) -> "ModelSpec":
        r = engine.runner
        return cls(Path(str(r.loaded.path)), r.loaded.name, r.arch, r.dtype, r.device,
                   tuple(engine.runtime_info.eos_token_ids))


def load_baseline(spec: ModelSpec, compile: bool = True) -> HFBaseline:
    """The transformers model matching the engine's weights, dtype and device."""
    path = spec.path
    if path.is_file() and path.suffix == ".gguf":
        model = _from_pretrained(str(path.parent), spec.dtype, gguf_file=path.name)
        source = f"GGUF {path.name} via transformers' GGUF loader"
    elif path.is_dir() and (path / "config.json").is_file():
        model, source = _from_pretrained(str(path), spec.dtype), f"HF directory {path.name}"
    else:
        model = _random_from_arch(spec.arch, spec.dtype, spec.device)
        source = f"random weights, architecture of {spec.name}"
    model.to(spec.device).eval()
    eos = list(spec.eos_token_ids)
    return HFBaseline(model, spec.device, source, eos[0] if eos else 0, eos, compile)


def _from_pretrained(location: str, dtype: torch.dtype, **kwargs: Any):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs)


def _random_from_arch(arch, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, rope_theta=arch.rope_theta, rope_scaling=arch.rope_scaling,
        rms_norm_eps=arch.rms_norm_eps, tie_word_embeddings=arch.tie_word_embeddings,
        attention_bias=arch.attention_bias, max_position_embeddings=arch.max_position_embeddings)
    with torch.device(device):  # initialise on the device: an 8B model in host RAM is slow
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# --- generate -----------------------------------------------------------------------------------

class _TokenTimer:
    """A transformers streamer that stamps each generated token (the first `put` is the prompt)."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(b: HFBaseline, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              num_new_tokens: int, static: bool, streamer=None) -> torch.Tensor:
    kwargs: dict[str, Any] = {}
    if static:
        kwargs["cache_implementation"] = "static"
    if not b.compile:
        kwargs["disable_compile"] = True
    with torch.inference_mode():
        return b.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_new_tokens,
            min_new_tokens=num_new_tokens, do_sample=False, temperature=None, top_p=None,
            top_k=None, pad_token_id=b.pad_token_id, eos_token_id=b.eos_token_ids or None,
            streamer=streamer, **kwargs)


def _left_padded(b: HFBaseline, prompts: Sequence[Sequence[int]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, max_len] ids and attention mask, padding on the left as decoder-only models need."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), b.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(b.device), mask.to(b.device)


def time_single(b: HFBaseline, prompt: Sequence[int], num_new_tokens: int,
                sync: Callable[[], None]) -> list[float]:
    """Batch 1: seconds from the call to each generated token."""
    ids, mask = _left_padded(b, [prompt])
    timer = _TokenTimer(sync)
    sync()
    start = time.perf_counter()
    _generate(b, ids, mask, num_new_tokens, b.static_cache, streamer=timer)
    return [t - start for t in timer.times]


def warm_up_single(b: HFBaseline, prompt: Sequence[int], num_new_tokens: int,
                   sync: Callable[[], None]) -> None:
    """Compile and first-touch at exactly the shapes that will be timed (static cache on GPU)."""
    n = num_new_tokens if b.static_cache else min(num_new_tokens, CPU_WARMUP_TOKENS)
    time_single(b, prompt, n, sync)


def run_batched(b: HFBaseline, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                batch_size: int, sync: Callable[[], None]) -> dict[str, Any]:
    """All prompts in chunks of `batch_size`, shortest prompts first (least padding).

    A chunk generates its longest requested output; only the requested tokens count as output.
    The static cache is used only when every chunk has the same shape: each new shape would be
    compiled again inside the timed region.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    uniform = len({len(p) for p in prompts}) == 1 and len(set(output_lens)) == 1
    static = b.static_cache and uniform
    batches = [(_left_padded(b, [prompts[i] for i in c]), max(output_lens[i] for i in c))
               for c in chunks]
    _warm_up_batches(b, batches, static)
    sync()
    start = time.perf_counter()
    for (ids, mask), n in batches:
        _generate(b, ids, mask, n, static)
    sync()
    elapsed = time.perf_counter() - start
    useful = sum(output_lens)
    return {"elapsed_s": elapsed, "output_tokens_per_s": useful / elapsed,
            "requests_per_s": len(prompts) / elapsed, "num_output_tokens": useful,
            "num_generated_tokens": sum(ids.shape[0] * n for (ids, _), n in batches),
            "batch_size": batch_size, "static_cache": static}


def _warm_up_batches(b: HFBaseline, batches, static: bool) -> None:
    if not static:
        (ids, mask), n = batches[0]
        _generate(b, ids, mask, min(n, CPU_WARMUP_TOKENS), static)
        return
    seen: set[tuple] = set()
    for (ids, mask), n in batches:  # a static cache compiles per (batch, length): run each once
        if (tuple(ids.shape), n) not in seen:
            seen.add((tuple(ids.shape), n))
            _generate(b, ids, mask, n, static)
