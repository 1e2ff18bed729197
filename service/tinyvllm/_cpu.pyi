"""tinyvllm._cpu: the CPU data plane (core_cpp/cpu/). Pointers are integers (`tensor.data_ptr()`);
sizes are checked and a bad one raises ValueError (IndexError for an id out of range). The GIL is
released while a kernel runs. Use it through `tinyvllm.ops.quantized` and `tinyvllm.ops.attention`.
"""

def linear(out: int, x: int, w: int, bias: int, qtype: int, m: int, n: int, k: int,
           x_stride: int, out_stride: int, isa: str = "auto") -> None:
    """out[m, n] = x[m, k] @ dequantize(w).T + bias (bias 0: none).

    w: [n, k / 32 * block_bytes] GGUF blocks of ggml type `qtype` (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;
    x quantized to int8 per 32 values), or [n, k / 256 * block_bytes] K-quant super-blocks
    (Q4_K = 12, Q5_K = 13, Q6_K = 14; x quantized to int8 per 256 values, integer dot
    products); x and out float32 with row strides x_stride and out_stride. isa: auto,
    avx512vnni, avx2 or scalar (TINYVLLM_CPU_ISA replaces auto).
    """

def int8_linear(out: int, x: int, w: int, w_scale: int, input_scale: int, scale_divisor: float,
                bias: int, m: int, n: int, k: int, x_stride: int, out_stride: int,
                isa: str = "auto") -> None:
    """out[m, n] float32 = (float(xq @ w.T) * x_scale) * w_scale (+ bias): w int8 [n, k], w_scale
    float32 [n], input_scale a float32 scalar or 0 (each row of x [m, x_stride] quantized to int8
    with scale max|row| / scale_divisor, as ops.w8a8_linear.quantize_rows_ref; 127 or 127.5),
    bias [n] or 0."""

def dequantize_rows(out: int, w: int, qtype: int, num_rows: int, k: int, row_ids: int,
                    num_ids: int) -> None:
    """out[num_ids, k] float32 = rows `row_ids` (int64) of the packed [num_rows, k] matrix."""

def paged_decode_attention(out: int, q: int, q_stride: int, kv_cache: int, num_blocks: int,
                           block_size: int, num_kv_heads: int, head_dim: int, num_heads: int,
                           block_tables: int, table_stride: int, seq_lens: int, num_seqs: int,
                           scale: float, kv_cache_dtype: str = "float32") -> None:
    """One query per sequence over the paged cache [2, num_blocks, block_size, num_kv_heads,
    head_dim] of kv_cache_dtype ("float32" or "float16"); block_tables [num_seqs, table_stride]
    and seq_lens int32."""

def to_float16(out: int, x: int, n: int, isa: str = "auto") -> None:
    """out[n] int16 = the IEEE half bits of float32 x[n], rounded to nearest even (the
    conversion of the half-precision cache writes)."""

def decoder_layers(residual: int, out: int, layers: list[int], final_norm: int, dims: list[int],
                   eps: float, scale: float, num_tokens: int, positions: int, slot_mapping: int,
                   cos_sin_cache: int, max_position: int, query_start_loc: int, seq_lens: int,
                   num_seqs: int, block_tables: int, table_stride: int, num_blocks: int,
                   block_size: int, kv_cache_dtype: str = "float32",
                   isa: str = "auto") -> None:
    """Every Llama decoder layer of one step, then the final RMSNorm (core_cpp/cpu/decoder.h).

    residual [num_tokens, hidden] float32: the embeddings on entry, the residual stream on return;
    out [num_tokens, hidden]: its final norm. layers: 12 integers per layer (input_norm, qkv
    weight, qkv qtype, qkv bias or 0, o weight, o qtype, post_attention_norm, gate_up weight,
    gate_up qtype, down weight, down qtype, KV cache of kv_cache_dtype: "float32" or "float16").
    dims: (hidden, num_heads, num_kv_heads, head_dim, intermediate). positions and slot_mapping
    int64 [num_tokens];
    query_start_loc [num_seqs + 1], seq_lens [num_seqs], block_tables [num_seqs, table_stride]
    int32, as ops.AttentionMetadata; cos_sin_cache [max_position, head_dim] float32.
    Use it through `tinyvllm.model.packed_decoder.PackedDecoder`.
    """

def set_num_threads(num_threads: int) -> None:
    """Replace the thread pool (0: the physical cores)."""

def num_threads() -> int: ...
def physical_cores() -> int: ...
def best_isa() -> str:
    """The best instruction set this CPU and build run (what auto selects): avx512vnni, avx2 or scalar."""
def isa_name(isa: str = "auto") -> str:
    """The kernels `isa` selects; raises ValueError for an unknown or unavailable one."""
