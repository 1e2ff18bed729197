"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over the paged KV cache.

Every norm, rotary, KV write, attention and activation goes through `tinyvllm.ops`, so that the CUDA
kernels plug in without touching this file. Projections are merged (`qkv_proj`, `gate_up_proj`);
`load_weights` takes Hugging Face tensor names and fills the merged weights.

Tensor parallelism (`tinyvllm.distributed`, one process per rank): each rank holds its query
heads, its KV heads (replicated where there are fewer KV heads than ranks) and its MLP columns
(column-parallel qkv_proj and gate_up_proj), the matching input columns of o_proj and down_proj
(row-parallel, each followed by one all-reduce), and a contiguous slice of the padded vocabulary
(embedding: masked lookup then all-reduce; head: local logits gathered to the full vocabulary).
`load_weights` reads only the rank's slice of each checkpoint tensor. At size 1 nothing of this
adds an op.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm import ops
from tinyvllm.distributed import TensorParallel, get_tp
from tinyvllm.model.arch import LlamaArch
from tinyvllm.model.parallel import VocabParallelEmbedding, read_part, vocab_rows

_KV_SCALE_BUFFERS = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")
"""Our names of the FP8 KV-cache scales (`kv_scale`: one scale for both, older checkpoints)."""

_KV_SCALE_NAMES = {
    "self_attn.k_proj.output_scale": "self_attn.k_scale",  # AutoFP8
    "self_attn.v_proj.output_scale": "self_attn.v_scale",
    "self_attn.k_proj.k_scale": "self_attn.k_scale",
    "self_attn.v_proj.v_scale": "self_attn.v_scale",
}
"""Checkpoint names of KV-cache scales other than ours (`self_attn.k_scale`, as vLLM and
llm-compressor write them) -> ours."""

# HF projection name -> (merged parameter name, shard index). Shard order is the row order.
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}

_VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")
"""Parameters that hold a rank's slice of the (padded) vocabulary as rows."""


class LlamaAttention(nn.Module):
    """Attention over this rank's heads (`arch` is the rank's, `LlamaArch.per_rank`)."""

    def __init__(self, arch: LlamaArch, tp: TensorParallel) -> None:
        super().__init__()
        self.arch, self.tp = arch, tp
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size,
                                  bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=False)
        self.scale = arch.head_dim ** -0.5
        # FP8 KV-cache scales (stored = x / scale): float32 device scalars that the kernels read
        # through a pointer; 1.0 unless the checkpoint has them. Unused with a 16/32-bit cache.
        for name in ("k_scale", "v_scale"):
            self.register_buffer(name, torch.ones((), dtype=torch.float32), persistent=False)

    def shard_sizes(self, name: str) -> list[int]:
        return [self.arch.q_size, self.arch.kv_size, self.arch.kv_size]

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor,
               meta: ops.AttentionMetadata, cos_sin_cache: torch.Tensor, *,
               merge: bool = True) -> torch.Tensor | ops.DecodePartitions:
        """Rotary, K/V cache write and attention of the projected qkv [T, q_size + 2 * kv_size];
        returns the attention output [T, q_size], before o_proj (with merge=False, a split CUDA
        decode's unmerged partitions, for ops.fused_linear)."""
        a = self.arch
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        num_tokens = qkv.shape[0]
        if ops.kernel_config().fused_rotary_cache:
            # Strided views into qkv; on CUDA decode one launch rotates, caches and attends.
            out = ops.rotary_paged_attention(positions, q, k, v, cos_sin_cache, kv_cache, meta,
                                             self.scale, self.k_scale, self.v_scale, merge=merge)
            if isinstance(out, ops.DecodePartitions):
                return out
        else:
            q, k = ops.rotary_embedding(positions, q.contiguous(), k.contiguous(), cos_sin_cache,
                                        a.head_dim)
            k = k.view(num_tokens, a.num_kv_heads, a.head_dim)
            v = v.contiguous().view(num_tokens, a.num_kv_heads, a.head_dim)
            ops.reshape_and_cache(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            out = ops.paged_attention(q.view(num_tokens, a.num_heads, a.head_dim), kv_cache, meta,
                                      self.scale, self.k_scale, self.v_scale)
        return out.reshape(num_tokens, a.q_size)


class LlamaMLP(nn.Module):
    """SwiGLU over this rank's intermediate_size columns (`arch` is the rank's)."""

    def __init__(self, arch: LlamaArch, tp: TensorParallel) -> None:
        super().__init__()
        self.arch, self.tp = arch, tp
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def shard_sizes(self, name: str) -> list[int]:
        return [self.arch.intermediate_size, self.arch.intermediate_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden] (or QuantizedRows, as LlamaAttention) -> the same."""
        act = _silu_and_mul(self.gate_up_proj(hidden), self.down_proj)
        return self.tp.all_reduce(self.down_proj(act))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TensorParallel) -> None:
        super().__init__()
        self.eps, self.tp = arch.rms_norm_eps, tp
        self.self_attn = LlamaAttention(arch, tp)
        self.mlp = LlamaMLP(arch, tp)
        self.input_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(arch.hidden_size))

    def forward(self, positions, hidden, residual: Optional[torch.Tensor], kv_cache, meta,
                cos_sin_cache):
        """Pre-norm block; the residual add is fused into the next norm (returns both streams).
        Writes this step's K/V before attending."""
        qkv, residual = self.before_attention(hidden, residual)
        out = self.self_attn.attend(positions, qkv, kv_cache, meta, cos_sin_cache)
        return self.after_attention(out, residual)

    def before_attention(self, hidden: torch.Tensor, residual: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block up to the attention: (qkv [T, q_size + 2 * kv_size], residual). Without a
        residual (the first layer) hidden is the next one."""
        hidden, residual = _rms_norm(hidden, self.input_layernorm, self.eps, residual,
                                     self.self_attn.qkv_proj)
        return self.self_attn.qkv_proj(hidden), residual

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block after the attention output attn [T, q_size]: o_proj (summed over the
        ranks), the residual add and norm, the MLP -> (hidden, residual)."""
        hidden = self.tp.all_reduce(self.self_attn.o_proj(attn))  # each rank's heads' share
        hidden, residual = _rms_norm(hidden, self.post_attention_layernorm, self.eps, residual,
                                     self.mlp.gate_up_proj)
        return self.mlp(hidden), residual

    def forward_fused(self, positions, residual: torch.Tensor, kv_cache, meta,
                      cos_sin_cache) -> None:
        """The same block for decode-sized batches: four fused projections (norm -> qkv,
        o_proj + add, norm -> gate_up -> SwiGLU, down_proj + add) update the residual stream
        [T, hidden] in place; no separate norm, activation or add launches, and o_proj merges a
        split decode's partitions itself."""
        attn, mlp = self.self_attn, self.mlp
        qkv = _fused_linear(attn.qkv_proj, residual, norm_weight=self.input_layernorm,
                            eps=self.eps)
        # A packed o_proj (no `weight`) takes the merged attention output.
        out = attn.attend(positions, qkv, kv_cache, meta, cos_sin_cache,
                          merge=(not ops.kernel_config().merge_in_o_proj
                                 or not hasattr(attn.o_proj, "weight")))
        # The attention leaves the memory bus idle: o_proj's weight heads for L2 meanwhile.
        self._add_row_parallel(out, attn.o_proj, residual, prefetch_weight=True)
        # gate_up_proj writes the SwiGLU product itself: down_proj stages half the values.
        hidden = _fused_linear(mlp.gate_up_proj, residual,
                               norm_weight=self.post_attention_layernorm, eps=self.eps,
                               silu_mul_out=True)
        self._add_row_parallel(hidden, mlp.down_proj, residual)

    def _add_row_parallel(self, x, proj: nn.Module, residual: torch.Tensor,
                          **kwargs: Any) -> None:
        """residual += proj(x) summed over the ranks: the GEMV's epilogue at size 1; else
        after the all-reduce, which must see the ranks' partial products alone."""
        if self.tp.size == 1:
            _fused_linear(proj, x, residual=residual, **kwargs)
        else:
            residual += self.tp.all_reduce(_fused_linear(proj, x, **kwargs))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: Optional[torch.Tensor], proj: nn.Module):
    """`ops.rms_norm` making the input of `proj` -> (normed, residual); without a residual x
    is the next one. Where proj asks for its input quantized (a W8A8 projection with dynamic
    scales on CUDA, `fused_input_quant`), `ops.rms_norm_quant` hands it QuantizedRows."""
    quant = _input_quant(proj, "rms_norm_quant", x)
    out = (ops.rms_norm(x, weight, eps, residual) if quant is None
           else ops.rms_norm_quant(x, weight, eps, residual, *quant))
    return (out, x) if residual is None else out


def _silu_and_mul(x: torch.Tensor, proj: nn.Module):
    """`ops.silu_and_mul` making the input of `proj`, quantized where `_rms_norm` would."""
    quant = _input_quant(proj, "silu_and_mul_quant", x)
    return ops.silu_and_mul(x) if quant is None else ops.silu_and_mul_quant(x, *quant)


def _input_quant(proj: nn.Module, op: str, x: torch.Tensor):
    """(qdtype, divisor) when `op` should quantize proj's input; None for float inputs."""
    fused = getattr(proj, "fused_input_quant", None)
    return None if fused is None else fused(op, x)


def _fused_linear(proj: nn.Module, x, **kwargs: Any) -> torch.Tensor:
    """`ops.fused_linear` over a float projection's weight and bias, or a packed projection's
    own fused GEMV (`fused_linear`: W4A16 tiles, which prefetch nothing ahead)."""
    fused = getattr(proj, "fused_linear", None)
    if fused is None:
        return ops.fused_linear(x, proj.weight, proj.bias, **kwargs)
    kwargs.pop("prefetch_weight", None)
    return fused(x, **kwargs)


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, tp) for _ in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF (`model.layers.0.self_attn.qkv_proj.weight`, ...), with norms as
    bare parameters (`model.layers.0.input_layernorm`) and merged projections.

    `arch` is the whole model's shape; `rank_arch` this rank's part (`LlamaArch.per_rank`: its
    num_heads, num_kv_heads and intermediate_size), which sizes its KV cache. `tp` defaults to
    this process's `get_tp()`.

    Raises:
        ValueError: a tensor-parallel size that does not split the model (`LlamaArch.per_rank`).
    """

    def __init__(self, arch: LlamaArch, tp: Optional[TensorParallel] = None) -> None:
        super().__init__()
        self.arch, self.tp = arch, tp or get_tp()
        self.rank_arch = arch.per_rank(self.tp.size)
        # The first KV head of this rank; ranks share one where there are fewer heads than ranks.
        self.kv_head_start = self.tp.rank * arch.num_kv_heads // self.tp.size
        self.model = LlamaModel(self.rank_arch, self.tp)
        self.lm_head = (None if arch.tie_word_embeddings
                        else nn.Linear(arch.hidden_size, vocab_rows(arch.vocab_size, self.tp.size),
                                       bias=False))
        # The fused CPU step over packed weights (model/packed_decoder.py), set by the packed
        # loader; None: every step runs the modules below.
        self.packed_decoder = None
        # float32 on purpose: rotary angles lose too much in bf16 (see _apply).
        self.register_buffer("cos_sin_cache", self._build_cos_sin_cache(None), persistent=False)

    def _build_cos_sin_cache(self, device) -> torch.Tensor:
        a = self.arch
        return ops.build_cos_sin_cache(a.head_dim, a.max_position_embeddings, a.rope_theta,
                                       a.rope_scaling, device=device)

    def _apply(self, fn, recurse: bool = True):
        # `.to(dtype)` would cast the rotary cache too; rebuild it in float32 on its new device.
        super()._apply(fn, recurse)
        cache = self.cos_sin_cache
        if cache.dtype != torch.float32 or cache.is_meta:
            self.cos_sin_cache = self._build_cos_sin_cache(cache.device)
        return self

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty`); KV scales back to 1.0."""
        self.cos_sin_cache = self._build_cos_sin_cache(self.cos_sin_cache.device)
        for name, buf in self.named_buffers():
            if name.endswith(_KV_SCALE_BUFFERS):
                buf.fill_(1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: ops.AttentionMetadata,
                num_layers: Optional[int] = None) -> torch.Tensor:
        """Run the decoder over one flat batch; `num_layers`: only the first ones (a
        layer-truncated self-draft, `worker/draft_model.py`), then the final norm.

        Shape:
            input_ids, positions: [num_tokens] int64
            kv_caches: one tensor per layer run, each ops.KV_CACHE_LAYOUT
            returns: [num_tokens, hidden_size] after the final norm
        """
        hidden = self.model.embed_tokens(input_ids)
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        if self.packed_decoder is not None and self.packed_decoder.serves(hidden, kv_caches):
            # the first len(kv_caches) layers: all, or a truncated self-draft's
            return self.packed_decoder(hidden, positions, kv_caches[:len(layers)], meta)
        if self.uses_fused_decode(hidden):
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                layer.forward_fused(positions, hidden, kv_cache, meta, self.cos_sin_cache)
            return ops.rms_norm(hidden, self.model.norm, self.arch.rms_norm_eps)
        x, residual = self.forward_piece(0, hidden, None, len(layers))
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            attn = layer.self_attn.attend(positions, x, kv_cache, meta, self.cos_sin_cache)
            x, residual = self.forward_piece(i + 1, attn, residual, len(layers))
        return x

    def forward_piece(self, index: int, x: torch.Tensor, residual: Optional[torch.Tensor],
                      num_layers: Optional[int] = None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The unfused forward between two attentions (piecewise CUDA graphs capture these,
        `worker/cuda_graph.py`). Piece 0 takes the embedded tokens x to layer 0's qkv; piece i
        takes layer i - 1's attention output x through the rest of that layer to layer i's
        qkv; the last (num_layers) ends with the final norm. Returns (qkv or, from the last,
        the normed hidden states; the residual stream, None from the last)."""
        layers = self.model.layers
        last = len(layers) if num_layers is None else num_layers
        if index > 0:
            x, residual = layers[index - 1].after_attention(x, residual)
        if index < last:
            return layers[index].before_attention(x, residual)
        if residual is None:  # no layer ran (num_layers 0): the embedding alone
            return ops.rms_norm(x, self.model.norm, self.arch.rms_norm_eps), None
        return ops.rms_norm(x, self.model.norm, self.arch.rms_norm_eps, residual)[0], None

    def uses_fused_decode(self, hidden: torch.Tensor) -> bool:
        """Whether the layers run `forward_fused` (ops decides: decode-sized CUDA batches)."""
        layer = self.model.layers[0]
        return ops.use_fused_decode(hidden, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Shape: hidden [num_seqs, hidden_size] -> [num_seqs, vocab_size] float32 (into `out`
        when given: a static buffer of a CUDA graph)."""
        if self.lm_head is not None and not isinstance(self.lm_head, nn.Linear):
            logits = self.lm_head(hidden)  # packed GGUF rows (model/packed.py), tied or not
        elif ops.kernel_config().fused_gemv:  # the GEMV kernel where it serves, else F.linear
            logits = ops.fused_linear(hidden, self.lm_head_weight)
        else:
            logits = F.linear(hidden, self.lm_head_weight)
        if self.tp.size > 1:  # each rank's vocabulary slice, in rank order; padding cut off
            logits = self.tp.all_gather(logits)[:, :self.arch.vocab_size]
        return logits.float() if out is None else out.copy_(logits)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy HF-named tensors into the (merged) parameters; returns the names it filled.

        Each tensor is the checkpoint's whole tensor, as a torch tensor or a safetensors lazy
        slice (`safe_open(...).get_slice`); only this rank's part of it is read (`_rank_part`).

        Raises:
            KeyError: a tensor name this model has no parameter for.
            ValueError: a tensor of the wrong shape.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name, shard = _our_name(hf_name)
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still ship a copy of the embedding
            if name.endswith(_KV_SCALE_BUFFERS):
                loaded |= self._load_kv_scale(hf_name, name, tensor[...])
                continue
            if name not in params:
                raise KeyError(f"unexpected weight {hf_name!r}")
            target = params[name]
            if shard is not None:
                module = self.get_submodule(name.rsplit(".", 2)[0])
                sizes = module.shard_sizes(name)
                start = sum(sizes[:shard])
                target = target.narrow(0, start, sizes[shard])
                loaded.add(f"{name}#{shard}")
            tensor = read_part(hf_name, tensor, self._rank_part(name, shard))
            if name in _VOCAB_PARAMS and self.tp.size > 1:  # rows past the vocabulary: zeros
                target[tensor.shape[0]:].zero_()
                target = target[:tensor.shape[0]]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
        return loaded

    def _rank_part(self, name: str, shard: Optional[int]) -> Optional[tuple[int, int, int, int]]:
        """(dim, start, length, whole length) of this rank's part of the checkpoint tensor that
        fills `name` (shard `shard` of a merged projection); None: every rank reads all of it
        (norms, and everything at size 1)."""
        if self.tp.size == 1:
            return None
        a, whole, rank = self.rank_arch, self.arch, self.tp.rank
        if "qkv_proj" in name:
            if shard == 0:
                return 0, rank * a.q_size, a.q_size, whole.q_size
            return 0, self.kv_head_start * a.head_dim, a.kv_size, whole.kv_size
        if "gate_up_proj" in name:
            return 0, rank * a.intermediate_size, a.intermediate_size, whole.intermediate_size
        if "o_proj" in name:
            return 1, rank * a.q_size, a.q_size, whole.q_size
        if "down_proj" in name:
            return 1, rank * a.intermediate_size, a.intermediate_size, whole.intermediate_size
        if name in _VOCAB_PARAMS:
            rows = vocab_rows(whole.vocab_size, self.tp.size)
            start = min(rank * rows, whole.vocab_size)
            return 0, start, min(rows, whole.vocab_size - start), whole.vocab_size
        return None

    def _load_kv_scale(self, hf_name: str, name: str, tensor: torch.Tensor) -> set[str]:
        """A checkpoint's FP8 KV-cache scale (`kv_scale` sets both K and V of its layer)."""
        value = tensor.float().reshape(-1)
        if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value) <= 0:
            raise ValueError(f"weight {hf_name!r}: expected one positive finite scale, got "
                             f"{tuple(tensor.shape)} {value[:4].tolist()}")
        prefix = name.rsplit(".", 1)[0]
        names = ({f"{prefix}.k_scale", f"{prefix}.v_scale"} if name.endswith(".kv_scale")
                 else {name})
        buffers = dict(self.named_buffers())
        for target in names:
            if target not in buffers:
                raise KeyError(f"unexpected weight {hf_name!r}")
            buffers[target].fill_(float(value))
        return names

    def expected_weight_names(self) -> set[str]:
        """What `load_weights` must fill for the model to be complete (merged shards counted)."""
        names = set()
        for name, _ in self.named_parameters():
            names.add(name)
            if "qkv_proj.weight" in name or "qkv_proj.bias" in name:
                names.update(f"{name}#{i}" for i in range(3))
            elif "gate_up_proj" in name:
                names.update(f"{name}#{i}" for i in range(2))
        return names


def _our_name(hf_name: str) -> tuple[str, Optional[int]]:
    """HF name -> (our parameter name, shard index or None)."""
    name = hf_name
    for old, new in _KV_SCALE_NAMES.items():  # FP8 KV-cache scales of the attention module
        if name.endswith(old):
            return name[:-len(old)] + new, None
    for norm in ("input_layernorm", "post_attention_layernorm"):
        name = name.replace(f"{norm}.weight", norm)
    if name == "model.norm.weight":
        name = "model.norm"
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        merged, shard = _STACKED[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard
    return name, None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_empty_model(arch: LlamaArch, dtype: torch.dtype, device: torch.device,
                      tp: Optional[TensorParallel] = None,
                      prepare: Optional[Callable[[LlamaForCausalLM], Any]] = None
                      ) -> LlamaForCausalLM:
    """An uninitialised model (this rank's part of it; `tp` defaults to `get_tp()`) allocated
    directly in `dtype` on `device` (no CPU float32 copy). `prepare(model)` runs before the
    allocation, still on the meta device in `dtype` (e.g. to swap in quantized projections)."""
    with _default_dtype(dtype), torch.device("meta"):
        model = LlamaForCausalLM(arch, tp)
        if prepare is not None:
            prepare(model)
    model.to_empty(device=device)
    model.init_buffers()
    return model.eval().requires_grad_(False)
