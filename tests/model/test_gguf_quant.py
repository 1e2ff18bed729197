"""GGUF tensor types: dequantized values and shapes, against hand-built blocks and the originals."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tinyvllm.model.loader import dequantize_gguf_tensor

ROWS, COLS = 3, 64  # two 32-element blocks per row

# Worst-case absolute error of a round trip, for values in [-1, 1].
ROUND_TRIP_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15,
                        Q.Q4_1: 0.1}


def _write(path, tensors: dict[str, tuple[np.ndarray, Q]]):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _f16_bytes(value: float) -> bytes:
    return np.float16(value).tobytes()


def _hand_built() -> dict[str, tuple[np.ndarray, Q, np.ndarray]]:
    """One row of two blocks per type, with values known in closed form."""
    q4 = np.arange(32) % 16  # 4-bit codes 0..15
    packed = (q4[:16] | (q4[16:] << 4)).astype(np.uint8).tobytes()  # low nibbles: elems 0..15
    q8 = (np.arange(32) - 16).astype(np.int8)
    blocks = {
        Q.Q8_0: (_f16_bytes(0.5) + q8.tobytes(), 0.5 * q8),
        Q.Q4_0: (_f16_bytes(0.25) + packed, 0.25 * (q4 - 8)),
        Q.Q4_1: (_f16_bytes(0.125) + _f16_bytes(-1.0) + packed, 0.125 * q4 - 1.0),
    }
    out = {}
    for qtype, (block, values) in blocks.items():
        raw = np.frombuffer(block * 2, dtype=np.uint8).reshape(1, -1)
        out[f"hand.{qtype.name}"] = (raw, qtype, np.concatenate([values, values])[None])
    return out


def test_hand_built_blocks(tmp_path):
    cases = _hand_built()
    tensors = _write(tmp_path / "hand.gguf", {n: (raw, q) for n, (raw, q, _) in cases.items()})
    for name, (_, _, expected) in cases.items():
        got = dequantize_gguf_tensor(tensors[name])
        assert got.shape == (1, 64) and got.dtype == np.float32
        np.testing.assert_array_equal(got, expected.astype(np.float32), err_msg=name)


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_TOLERANCE), ids=lambda q: q.name)
def test_round_trip(qtype, tmp_path):
    rng = np.random.default_rng(0)
    original = rng.uniform(-1, 1, size=(ROWS, COLS)).astype(np.float32)
    data = original if qtype == Q.F32 else gguf.quants.quantize(original, qtype)
    tensors = _write(tmp_path / "t.gguf", {"w": (data, qtype)})
    got = dequantize_gguf_tensor(tensors["w"])
    assert got.shape == (ROWS, COLS)  # torch order: rows first
    assert np.abs(got - original).max() <= ROUND_TRIP_TOLERANCE[qtype]
    got.flat[0] = 0.0  # writable: safe to hand to torch.from_numpy


# Types gguf.quants can quantize (beyond those above) and the worst round-trip error seen for
# values in [-1, 1], with margin.
QUANTIZABLE_TOLERANCE = {Q.Q5_0: 0.08, Q.Q5_1: 0.05, Q.MXFP4: 0.3}


@pytest.mark.parametrize("qtype", list(QUANTIZABLE_TOLERANCE), ids=lambda q: q.name)
def test_round_trip_more_types(qtype, tmp_path):
    rng = np.random.default_rng(1)
    original = rng.uniform(-1, 1, size=(ROWS, COLS)).astype(np.float32)
    tensors = _write(tmp_path / "t.gguf", {"w": (gguf.quants.quantize(original, qtype), qtype)})
    got = dequantize_gguf_tensor(tensors["w"])
    assert got.shape == (ROWS, COLS)
    assert np.abs(got - original).max() <= QUANTIZABLE_TOLERANCE[qtype]


def _k_quant_types() -> list[Q]:
    """Every type gguf dequantizes but cannot quantize (K-quants, IQ*, ...)."""
    covered = set(ROUND_TRIP_TOLERANCE) | set(QUANTIZABLE_TOLERANCE)
    return [t for t in gguf.quants._type_traits if t not in covered]


@pytest.mark.parametrize("qtype", _k_quant_types(), ids=lambda q: q.name)
def test_every_dequantizable_type_loads(qtype, tmp_path):
    """Q4_K_M / Q5_K_M / Q6_K / IQ* files: random blocks written with the gguf writer come back
    in row-major shape with gguf's values (every byte < 0x3C keeps each f16 scale finite)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    cols = 2 * max(block_size, 256)
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 0x3C, size=(ROWS, cols // block_size * type_size), dtype=np.uint8)
    tensors = _write(tmp_path / "k.gguf", {"w": (raw, qtype)})
    got = dequantize_gguf_tensor(tensors["w"])
    assert got.shape == (ROWS, cols) and got.dtype == np.float32
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    for row in range(ROWS):  # each row dequantized on its own: rows are not interleaved
        np.testing.assert_array_equal(got[row], gguf.quants.dequantize(raw[row], qtype))


def test_q4_k_hand_built_block(tmp_path):
    """One Q4_K super-block in closed form: d=0.5, every sub-block scale 1 and min 0, so that
    value = 0.5 * code; codes are l % 16 in the low nibbles and 15 - l % 16 in the high ones."""
    scales = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])  # 6-bit scales/mins packed as ggml does
    low = np.arange(32) % 16
    qs = ((low | ((15 - low) << 4)).astype(np.uint8).tobytes()) * 4
    block = _f16_bytes(0.5) + _f16_bytes(0.25) + scales + qs
    codes = np.concatenate([np.concatenate([low, 15 - low])] * 4)  # 4 chunks of 64 values
    tensors = _write(tmp_path / "q4k.gguf",
                     {"w": (np.frombuffer(block, dtype=np.uint8).reshape(1, -1), Q.Q4_K)})
    np.testing.assert_array_equal(dequantize_gguf_tensor(tensors["w"]),
                                  (0.5 * codes).astype(np.float32)[None])


def test_unsupported_type_names_tensor(tmp_path):
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]  # gguf cannot dequantize Q8_1
    raw = np.zeros((ROWS, COLS // block_size * type_size), dtype=np.uint8)
    tensors = _write(tmp_path / "q8_1.gguf", {"blk.7.ffn_up.weight": (raw, Q.Q8_1)})
    with pytest.raises(ValueError, match=r"blk\.7\.ffn_up\.weight.*Q8_1.*Q4_K"):
        dequantize_gguf_tensor(tensors["blk.7.ffn_up.weight"])
