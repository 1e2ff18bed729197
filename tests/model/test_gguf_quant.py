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


def test_unsupported_type_names_tensor(tmp_path):
    original = np.zeros((ROWS, COLS), dtype=np.float32)
    tensors = _write(tmp_path / "q5.gguf",
                     {"blk.7.ffn_up.weight": (gguf.quants.quantize(original, Q.Q5_0), Q.Q5_0)})
    with pytest.raises(ValueError, match=r"blk\.7\.ffn_up\.weight.*Q5_0"):
        dequantize_gguf_tensor(tensors["blk.7.ffn_up.weight"])
