"""Modules over GGUF weights kept packed, and loading a GGUF file into them (the CPU data plane,
and a GPU with `--no-dequantize`).

`load_gguf_packed` builds the Llama model with every projection (qkv, o, gate_up, down, lm_head)
whose GGUF tensors the kernels read (`ops.quantized.PACKED_TYPES`) as a `PackedLinear` over the
file's bytes, and a quantized token embedding as a `PackedEmbedding` (sharing its bytes with a
tied lm_head). Everything else (norms, biases, any
other quantization type) is dequantized and loaded as today, and each such projection is named in
one log line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from tinyvllm.model.arch import LlamaArch
from tinyvllm.model.llama import LlamaForCausalLM, build_empty_model
from tinyvllm.ops import quantized as q

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """y = x @ dequantize(qweight).T + bias over packed GGUF rows (one row per output feature):
    the C++ kernels on the CPU (float32 x), the CUDA block GEMV on a GPU (16-bit x).

    Shape: qweight [out_features, row_bytes] uint8 (a buffer: loaded, never trained).
    """

    def __init__(self, qweight: torch.Tensor, qtype: int, in_features: int,
                 bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        q.row_bytes(qtype, in_features)  # validates type and size
        self.register_buffer("qweight", qweight, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] float32 -> [..., out_features] float32."""
        return q.quantized_linear(x, self.qweight, self.qtype, self.in_features, self.bias)

    def fused_serves(self, x: torch.Tensor) -> bool:
        """Whether `fused_linear` over activations like x [m, in_features] is one GEMV launch
        (`ops.use_fused_decode` asks: the decoder then runs `forward_fused`)."""
        return q.fused_gemv_serves(x, self.qweight)

    def fused_linear(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`ops.fused_linear(x, weight, bias, **kwargs)` over the packed rows
        (`ops.quantized.quantized_fused_linear`)."""
        return q.quantized_fused_linear(x, self.qweight, self.qtype, self.in_features, self.bias,
                                        **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype}, bias={self.bias is not None}")


class PackedShards(nn.Module):
    """A stacked projection (qkv, gate_up) whose GGUF shards are of different types, as llama.cpp's
    mixed quantizations write them (Q4_K_M keeps attn_v at Q6_K in some layers beside Q4_K q and
    k): one PackedLinear per shard, their outputs side by side in row order, then the bias.
    The fused CPU decoder step runs the shards the same way (model/packed_decoder.py)."""

    def __init__(self, parts: list[PackedLinear], bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] float32 -> [..., out_features] float32."""
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    def fused_serves(self, x: torch.Tensor) -> bool:
        """Whether each shard's GEMV serves activations like x (`PackedLinear.fused_serves`)."""
        return all(p.fused_serves(x) for p in self.parts)

    def fused_linear(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`ops.fused_linear`'s result with the norm, SwiGLU and residual add as their own ops
        around the shards' GEMVs (gate and up rows of different types pair in no one launch)."""
        from tinyvllm.ops.linear import linear_unfused

        return linear_unfused(x, self.forward, **kwargs)


class PackedEmbedding(nn.Module):
    """Token embedding over packed rows: each lookup dequantizes the rows it needs (to `dtype`:
    float32 on the CPU, the model's 16-bit dtype on a GPU)."""

    def __init__(self, qweight: torch.Tensor, qtype: int, embedding_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.qtype, self.embedding_dim, self.dtype = qtype, embedding_dim, dtype
        self.register_buffer("qweight", qweight, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] int64 -> [..., embedding_dim]."""
        return q.embedding_rows(self.qweight, self.qtype, self.embedding_dim, ids, self.dtype)


# GGUF tensor names of each projection, by our module path; shards in row order.
def _projections(arch: LlamaArch) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for i in range(arch.num_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        out[f"{p}.self_attn.qkv_proj"] = [f"{b}.attn_q", f"{b}.attn_k", f"{b}.attn_v"]
        out[f"{p}.self_attn.o_proj"] = [f"{b}.attn_output"]
        out[f"{p}.mlp.gate_up_proj"] = [f"{b}.ffn_gate", f"{b}.ffn_up"]
        out[f"{p}.mlp.down_proj"] = [f"{b}.ffn_down"]
    return out


def _packed_rows(t: Any, arch: LlamaArch, permuted: bool) -> np.ndarray:
    """The tensor's bytes as [rows, row_bytes], q/k rows back in HF order (see unpermute)."""
    from tinyvllm.model.loader import unpermute_rope_rows

    rows = np.asarray(t.data).reshape(int(t.shape[-1]), -1)
    heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}.get(t.name.split(".")[-2])
    if permuted and heads is not None:
        return unpermute_rope_rows(torch.from_numpy(rows.copy()), heads).numpy()
    return rows


def _kernel_type(tensors: list[Any]) -> Optional[int]:
    """The shared type code when every tensor is of one type the kernels read, else None."""
    names = {t.tensor_type.name for t in tensors}
    if len(names) != 1 or next(iter(names)) not in q.PACKED_TYPES:
        return None
    return q.PACKED_TYPES[names.pop()]


def _pack(tensors: list[Any], arch: LlamaArch,
          permuted: bool) -> Optional[tuple[torch.Tensor, int, int]]:
    """(qweight [n, row_bytes], type code, k) of the stacked shards, or None when not packable."""
    qtype = _kernel_type(tensors)
    k = int(tensors[0].shape[0])  # ggml order: [k, n]
    if qtype is None or k % q.block_values(qtype):
        return None
    rows = [_packed_rows(t, arch, permuted) for t in tensors]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(rows))), qtype, k


def pack_model(net: LlamaForCausalLM, tensors: dict[str, Any], arch: LlamaArch,
               permuted: bool, device: torch.device = torch.device("cpu"),
               dtype: torch.dtype = torch.float32) -> set[str]:
    """Swap net's projections (and a quantized embedding) for packed modules over the file's
    bytes; returns the GGUF tensor names now served packed (the rest load dequantized)."""
    packed: set[str] = set()
    fallback: dict[str, list[str]] = {}
    for path, stems in _projections(arch).items():
        weights = [tensors[f"{s}.weight"] for s in stems]
        got = _pack(weights, arch, permuted)
        # A stack whose shards differ in type: each shard packed on its own, if each can be.
        shards = ([] if got is not None or len(weights) == 1
                  else [_pack([w], arch, permuted) for w in weights])
        if got is None and (not shards or None in shards):
            fallback.setdefault("/".join(sorted({w.tensor_type.name for w in weights})),
                                []).append(path)
            continue
        parent, name = path.rsplit(".", 1)
        old = net.get_submodule(path)
        bias = None if old.bias is None else torch.zeros_like(old.bias)  # loaded later
        if got is not None:
            qweight, qtype, k = got
            module = PackedLinear(qweight.to(device), qtype, k, bias=bias)
        else:  # shards of several types the kernels read, each packed on its own
            module = PackedShards([PackedLinear(qweight.to(device), qtype, k)
                                   for qweight, qtype, k in shards], bias=bias)
        setattr(net.get_submodule(parent), name, module)
        packed.update(f"{s}.weight" for s in stems)
    packed |= _pack_embedding_and_head(net, tensors, arch, fallback, device, dtype)
    for types, paths in fallback.items():
        logger.info("%s kernels read %s; %d projection(s) of type %s run on the torch path, "
                    "dequantized (e.g. %s)", device.type.upper(), ", ".join(q.PACKED_TYPES),
                    len(paths), types, paths[0])
    return packed


def _pack_embedding_and_head(net: LlamaForCausalLM, tensors: dict[str, Any], arch: LlamaArch,
                             fallback: dict[str, list[str]], device: torch.device,
                             dtype: torch.dtype) -> set[str]:
    """A quantized token_embd becomes a PackedEmbedding; the lm_head (output.weight, or the
    embedding itself when tied, as in SmolLM2) a PackedLinear over the same bytes."""
    packed: set[str] = set()
    embd = tensors["token_embd.weight"]
    embedding = _pack([embd], arch, False)
    if embedding is not None:
        embedding = (embedding[0].to(device),) + embedding[1:]
        net.model.embed_tokens = PackedEmbedding(embedding[0], embedding[1], arch.hidden_size,
                                                 dtype)
        packed.add(embd.name)
    head_tensor = tensors.get("output.weight")
    if head_tensor is None and not arch.tie_word_embeddings:
        return packed  # the loader reports the missing weight
    head = embedding if head_tensor is None else _pack([head_tensor], arch, False)
    if head is not None:
        head = (head[0].to(device),) + head[1:]
    if head is None:
        fallback.setdefault((head_tensor or embd).tensor_type.name, []).append("lm_head")
        return packed
    net.lm_head = PackedLinear(head[0], head[1], arch.hidden_size)
    if head_tensor is not None:
        packed.add(head_tensor.name)
    return packed


def open_gguf_tensors(path: Path) -> tuple[LlamaArch, Any, dict[str, Any], bool]:
    """(arch, tokenizer, GGUF tensors by name, whether q/k rows are permuted) of a GGUF file."""
    from tinyvllm.model import loader
    from tinyvllm.model_files import model_name, read_gguf
    from tinyvllm.tokenization import tokenizer_from_gguf_metadata

    reader, meta = read_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    freqs = tensors.pop(loader._GGUF_ROPE_FREQS, None)
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # ggml order: [hidden, vocab]
    arch = LlamaArch.from_gguf_metadata(
        meta, set(tensors) | ({loader._GGUF_ROPE_FREQS} if freqs is not None else set()),
        vocab_size,
        rope_freq_factors=None if freqs is None else loader.dequantize_gguf_tensor(freqs))
    tokenizer = tokenizer_from_gguf_metadata(meta, vocab_size=vocab_size, name=model_name(path))
    # llama.cpp permutes q/k rows for its interleaved rope only for the `llama` architecture.
    return arch, tokenizer, tensors, meta["general.architecture"] == "llama"


def load_gguf_packed(path: Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """A LoadedModel of a GGUF file with its quantized projections kept packed (the CPU with
    float32 activations, or a GPU with 16-bit ones). Raises as `loader.load_model` does."""
    from tinyvllm.model import loader
    from tinyvllm.model_files import model_name

    arch, tokenizer, tensors, permuted = open_gguf_tensors(path)
    net = build_empty_model(arch, dtype, device)
    packed = pack_model(net, tensors, arch, permuted, device, dtype)
    rest = [t for name, t in tensors.items() if name not in packed]
    loaded = net.load_weights(loader._iter_gguf(rest, arch, permuted))
    missing = net.expected_weight_names() - loaded
    if missing:
        raise ValueError(f"{path.name}: missing weights {sorted(missing)[:8]}")
    if device.type == "cpu":  # the fused C++ decoder step (model/packed_decoder.py)
        from tinyvllm.model.packed_decoder import PackedDecoder
        net.packed_decoder = PackedDecoder.for_model(net)
    logger.info("%s: %d GGUF tensors kept packed for the %s kernels, %d dequantized",
                path.name, len(packed), device.type.upper(), len(rest))
    return loader.LoadedModel(model=net, arch=arch, tokenizer=tokenizer, name=model_name(path),
                              path=path, max_model_len=arch.max_position_embeddings)


def packed_unsupported(dtype: torch.dtype, device: torch.device,
                       tensor_parallel_size: int = 1) -> Optional[str]:
    """Why the packed path cannot serve this load (None: it can)."""
    if tensor_parallel_size > 1:  # the packed modules hold whole projections
        return (f"the packed GGUF kernels serve one rank, not tensor_parallel_size "
                f"{tensor_parallel_size}")
    if device.type == "cuda":
        from tinyvllm.ops._dispatch import kernel_enabled

        if dtype not in (torch.float16, torch.bfloat16):
            return f"the CUDA GGUF kernels take float16 / bfloat16 activations, not {dtype}"
        if not kernel_enabled("gguf_linear"):
            return "the CUDA GGUF kernels do not run on this GPU (or tinyvllm._cuda is absent)"
        return None
    if device.type != "cpu":
        return f"the packed GGUF kernels run on the CPU or a CUDA GPU, not {device}"
    if dtype != torch.float32:
        return f"the packed GGUF kernels take float32 activations, not {dtype}"
    if q.cpu_kernels() is None:
        return "the CPU kernel module tinyvllm._cpu is not built"
    return None
