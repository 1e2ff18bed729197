"""Persistent per-step inputs of the model runner: one pinned host staging area and its device twin.

Every input of a step (token ids, positions, slot mapping, query start offsets, context lengths,
block tables, rows to sample, the in-flight token fills below) is a section of one byte buffer,
pinned on CUDA, with a device buffer of the same size. `begin(num_tokens, num_rows, width)` lays
the step's sections out back to back at offsets that depend only on those three sizes; the runner
writes the step into the host sections through numpy views, then `upload` queues a single
non-blocking copy of the used bytes (one copy instead of one per input: each costs ~20 us of host
time). The device buffer never moves and a layout's offsets are fixed, so a CUDA graph captured
over the sections of (batch size, batch size, width) sees every later step of that shape. On the
CPU the host buffer is the device buffer.

A decode row whose input token was sampled by the step still in flight (async scheduling) gets a
placeholder in the host array; `fill_prev_token_ids` then copies the id from that step's samples
on the device, behind the upload and before the forward (graph replays read the same buffer).

Block tables are flat: a step with `num_rows` rows of `width` entries uses `num_rows * width`
elements, viewed as a contiguous [num_rows, width] tensor (what the kernels take). Graphs use their
own fixed width; eager steps use the batch's longest table.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tinyvllm.ops import AttentionMetadata
from tinyvllm.ops.kv_cache import PADDING_SLOT

_ALIGN = 16  # bytes: every section starts 16-byte aligned (vector loads in the kernels)

# name, dtype, length in (tokens, rows, rows * width, constant) units: in this order in a layout,
# so that the sections a decode graph reads (the first six) sit at offsets fixed by its shape.
_SECTIONS = (
    ("input_ids", torch.int64, (1, 0, 0, 0)),
    ("positions", torch.int64, (1, 0, 0, 0)),
    ("slot_mapping", torch.int64, (1, 0, 0, 0)),
    ("query_start_loc", torch.int32, (0, 1, 0, 1)),
    ("seq_lens", torch.int32, (0, 1, 0, 0)),
    ("block_tables", torch.int32, (0, 0, 1, 0)),
    ("logits_indices", torch.int64, (1, 0, 0, 0)),  # speculation: up to one per token
    ("prev_token_dst", torch.int64, (0, 1, 0, 0)),
    ("prev_token_src", torch.int64, (0, 1, 0, 0)),
)

_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}

_LAYOUT_CACHE_SIZE = 64  # layouts kept (graph shapes repeat; prefill shapes come and go)


class _Section:
    """One input in the current layout: a numpy view of its host bytes and the device tensor."""

    __slots__ = ("np", "device")

    def __init__(self, np_view: np.ndarray, device: torch.Tensor):
        self.np = np_view
        self.device = device


class InputBuffers:
    """Host and device buffers for steps of up to `max_num_tokens` tokens and `max_num_seqs` rows.

    Shape (device tensors of the current layout):
        input_ids, positions, slot_mapping: [num_tokens] int64
        query_start_loc: [num_rows + 1] int32
        seq_lens: [num_rows] int32
        block_tables: [num_rows * width] int32, viewed [num_rows, width]
        logits_indices: [num_tokens] int64 (the first num_sampled used)
        prev_token_dst, prev_token_src: [num_rows] int64 (the first num_prev_tokens used):
            input_ids positions to fill from the previous step's sampled ids, and the rows of those
    """

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device):
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        on_gpu = device.type == "cuda"
        size = self._sizes(max_num_tokens, max_num_seqs, max_blocks_per_seq)[-1][1]
        self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=on_gpu)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(size, dtype=torch.uint8, device=device) if on_gpu else self._host
        self._layouts: dict[tuple[int, int, int], tuple[int, list[_Section]]] = {}
        self._used = 0  # bytes of the current layout
        # Recorded after each upload: the host arrays may be rewritten once the copy has run.
        self._uploaded: Optional[torch.cuda.Event] = torch.cuda.Event() if on_gpu else None
        self.begin(max_num_tokens, max_num_seqs, max_blocks_per_seq)

    @staticmethod
    def _sizes(num_tokens: int, num_rows: int, width: int) -> list[tuple[int, int]]:
        """(offset, end) in bytes of each section, in _SECTIONS order."""
        out, offset = [], 0
        for _, dtype, (per_token, per_row, per_entry, extra) in _SECTIONS:
            count = (per_token * num_tokens + per_row * num_rows + per_entry * num_rows * width
                     + extra)
            end = offset + count * dtype.itemsize
            out.append((offset, end))
            offset = -(-end // _ALIGN) * _ALIGN
        return out

    def begin(self, num_tokens: int, num_rows: int, width: int) -> None:
        """Point every section at its place in the layout of a step of this shape."""
        assert (num_tokens <= self.max_num_tokens and num_rows <= self.max_num_seqs
                and width <= self.max_blocks_per_seq), (num_tokens, num_rows, width)
        key = (num_tokens, num_rows, width)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= _LAYOUT_CACHE_SIZE:
                self._layouts.pop(next(iter(self._layouts)))
            sections = []
            spans = self._sizes(num_tokens, num_rows, width)
            for (_, dtype, _), (start, end) in zip(_SECTIONS, spans):
                host = self._host_np[start:end].view(_NP_DTYPES[dtype])
                sections.append(_Section(host, self._device[start:end].view(dtype)))
            layout = self._layouts[key] = (spans[-1][1], sections)
        self._used, sections = layout
        for (name, _, _), section in zip(_SECTIONS, sections):
            setattr(self, name, section)

    def wait_until_writable(self) -> None:
        """Block until the previous step's copy has read the host buffer.

        Usually free or short: the copy comes first in the previous step's device work, which
        starts once the step before it is done, and the engine has usually waited for that one
        already (it processes a step's samples before launching the step after next).
        """
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def block_table_rows(self, num_rows: int, width: int) -> np.ndarray:
        """The host block tables as a writable [num_rows, width] view, zeroed (0 = null block)."""
        rows = self.block_tables.np[:num_rows * width].reshape(num_rows, width)
        rows.fill(0)
        return rows

    def pad_decode_rows(self, first: int, end: int) -> None:
        """Rows [first, end) of a decode layout (row i is token i) as padding: token 0 at
        position 0, no KV write, a context of 1 token in the null block (their block-table rows
        must be zero, as `block_table_rows` leaves them)."""
        self.input_ids.np[first:end] = 0
        self.positions.np[first:end] = 0
        self.slot_mapping.np[first:end] = PADDING_SLOT
        self.query_start_loc.np[first:end + 1] = np.arange(first, end + 1)
        self.seq_lens.np[first:end] = 1

    def upload(self) -> None:
        """Queue the host-to-device copy of the current layout (non-blocking)."""
        if self._uploaded is not None:
            self._device[:self._used].copy_(self._host[:self._used], non_blocking=True)
            self._uploaded.record()

    def fill_prev_token_ids(self, num_prev_tokens: int, prev_sampled: torch.Tensor) -> None:
        """input_ids[dst[i]] = prev_sampled[src[i]] for the first num_prev_tokens pairs, on the
        device stream after `upload` (which wrote placeholders there).

        Shape: prev_sampled [num_rows of the previous step] int64, on the buffers' device.
        """
        n = num_prev_tokens
        dst, src = self.prev_token_dst.np[:n], self.prev_token_src.np[:n]
        if _is_run(dst) and _is_run(src):  # the usual decode batch: one copy, no gather
            d, s = int(dst[0]), int(src[0])
            self.input_ids.device[d:d + n].copy_(prev_sampled[s:s + n])
            return
        gathered = prev_sampled.index_select(0, self.prev_token_src.device[:n])
        self.input_ids.device.index_copy_(0, self.prev_token_dst.device[:n], gathered)

    def metadata(self, num_tokens: int, num_rows: int, width: int, max_query_len: int,
                 max_seq_len: int) -> AttentionMetadata:
        """AttentionMetadata over the device buffers' first `num_rows` rows.

        The host lists come from the host arrays, which hold this step's values until the next
        `wait_until_writable`.
        """
        qsl = self.query_start_loc.np[:num_rows + 1].tolist()
        return AttentionMetadata(
            num_tokens=num_tokens,
            slot_mapping=self.slot_mapping.device[:num_tokens],
            query_start_loc=self.query_start_loc.device[:num_rows + 1],
            seq_lens=self.seq_lens.device[:num_rows],
            block_tables=self.block_tables.device[:num_rows * width].view(num_rows, width),
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl, seq_lens_cpu=self.seq_lens.np[:num_rows].tolist())

    def input_ids_device(self, num_tokens: int) -> torch.Tensor:
        return self.input_ids.device[:num_tokens]

    def positions_device(self, num_tokens: int) -> torch.Tensor:
        return self.positions.device[:num_tokens]

    def logits_indices_device(self, num_sampled: int) -> torch.Tensor:
        return self.logits_indices.device[:num_sampled]


def _is_run(a: np.ndarray) -> bool:
    """a is a, a + 1, a + 2, ... (non-empty)."""
    return len(a) == 1 or int(a[-1]) - int(a[0]) == len(a) - 1 and bool((np.diff(a) == 1).all())
