"""The shape of a Llama-family model, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
_REQUIRED_HF_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers",
                     "intermediate_size", "vocab_size")

# Llama 3.1 GGUFs carry rope scaling as a `rope_freqs` tensor; these are the published constants
# that produced it (see `rope_scaling_from_freq_factors`).
_LLAMA3_ORIGINAL_CONTEXT = 8192
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0


@dataclass(frozen=True)
class LlamaArch:
    """Hyper-parameters of a Llama / Mistral / Qwen2 decoder."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    """None, or a HF-style dict with `rope_type` (`llama3` or `linear`) and its parameters."""
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    max_position_embeddings: int = 4096
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def per_rank(self, tensor_parallel_size: int) -> "LlamaArch":
        """One rank's shape under tensor parallelism: num_heads / size query heads,
        num_kv_heads / size KV heads (one, replicated, where there are fewer KV heads than ranks)
        and intermediate_size / size MLP columns. hidden_size, head_dim and vocab_size stay whole
        (the vocabulary is split by the embedding and the head themselves).

        Raises:
            ValueError: a count the size does not split, naming the numbers.
        """
        size = tensor_parallel_size
        if size == 1:
            return self
        errors = []
        if self.num_heads % size:
            errors.append(f"num_attention_heads {self.num_heads} is not divisible by it")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            errors.append(f"num_key_value_heads {self.num_kv_heads} neither is divisible by it "
                          "nor divides it")
        if self.intermediate_size % size:
            errors.append(f"intermediate_size {self.intermediate_size} is not divisible by it")
        if errors:
            raise ValueError(f"{self.name}: tensor_parallel_size {size} does not split the "
                             f"model: {'; '.join(errors)}")
        return dataclasses.replace(self, num_heads=self.num_heads // size,
                                   num_kv_heads=max(1, self.num_kv_heads // size),
                                   intermediate_size=self.intermediate_size // size)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: Optional[str] = None) -> "LlamaArch":
        """Build from a parsed config.json.

        Raises:
            ValueError: the architecture is not one of SUPPORTED_HF_ARCHITECTURES (named).
        """
        archs = config.get("architectures") or []
        arch = archs[0] if archs else config.get("model_type", "<missing>")
        if arch not in SUPPORTED_HF_ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_HF_ARCHITECTURES)}")
        missing = [k for k in _REQUIRED_HF_KEYS if k not in config]
        if missing:
            raise ValueError(f"config.json of {name or arch!r} lacks {', '.join(missing)}")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(config)
        return cls(
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            max_position_embeddings=_max_positions(config, arch),
            name=name or config.get("_name_or_path") or arch,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], tensor_names: set[str],
                           vocab_size: int, rope_freq_factors=None) -> "LlamaArch":
        """Build from GGUF key/value metadata (`{arch}.*` keys).

        Args:
            meta: metadata key -> python value.
            tensor_names: names of the file's tensors (embeddings are tied when
                `output.weight` is absent).
            vocab_size: rows of the token embedding.
            rope_freq_factors: the `rope_freqs.weight` tensor (Llama 3.1 rope scaling), or None.
        """
        arch = meta.get("general.architecture", "<missing>")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")

        def key(suffix: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{suffix}", default)

        hidden, heads = key("embedding_length"), key("attention.head_count")
        head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
        return cls(
            hidden_size=hidden,
            num_layers=key("block_count"),
            num_heads=heads,
            num_kv_heads=key("attention.head_count_kv") or heads,
            head_dim=head_dim,
            intermediate_size=key("feed_forward_length"),
            vocab_size=vocab_size,
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(meta, arch, head_dim, key("rope.freq_base", 10000.0),
                                            rope_freq_factors),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            max_position_embeddings=key("context_length", 4096),
            name=meta.get("general.name") or arch,
        )


def _max_positions(config: Mapping[str, Any], arch: str) -> int:
    """Context length. Sliding-window attention is not implemented, so a model that uses it is
    capped at its window, where full attention gives the same result."""
    limit = config.get("max_position_embeddings", 4096)
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", arch == "MistralForCausalLM")
    return min(limit, window) if window and uses_window else limit


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from the classic keys or transformers 5 `rope_parameters`."""
    params = config.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(theta), None if kind == "default" else scaling
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(config.get("rope_theta", 10000.0)), dict(scaling) if scaling else None


def _gguf_rope_scaling(meta: Mapping[str, Any], arch: str, head_dim: int, base: float,
                       rope_freq_factors) -> Optional[dict]:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if rope_freq_factors is not None:
        return rope_scaling_from_freq_factors(rope_freq_factors, head_dim, base)
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (only linear and "
                         "Llama 3 rope_freqs)")
    return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}


def rope_scaling_from_freq_factors(factors, head_dim: int, base: float) -> dict:
    """Recover the Llama 3 rope_scaling dict that produced a GGUF `rope_freqs` tensor.

    llama.cpp stores per-frequency divisors; the largest is `factor`. We rebuild the HF dict with
    the standard Llama 3.1 constants and check that it reproduces every divisor.
    """
    import torch

    factors = torch.as_tensor(factors, dtype=torch.float64).flatten()
    scaling = {"rope_type": "llama3", "factor": float(factors.max()),
               "low_freq_factor": _LLAMA3_LOW_FREQ_FACTOR,
               "high_freq_factor": _LLAMA3_HIGH_FREQ_FACTOR,
               "original_max_position_embeddings": _LLAMA3_ORIGINAL_CONTEXT}
    from tinyvllm.ops.layers import _scale_inv_freq

    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    expected = inv_freq / _scale_inv_freq(inv_freq, scaling)
    if expected.shape != factors.shape or not torch.allclose(expected, factors, rtol=1e-3):
        raise ValueError("GGUF rope_freqs tensor does not match Llama 3 rope scaling; unsupported")
    return scaling
