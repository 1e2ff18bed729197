"""Persistent per-step inputs of the model runner: host staging arrays and their device twins.

Every input of a step (token ids, positions, slot mapping, query start offsets, context lengths,
block tables, rows to sample) has one host buffer, pinned on CUDA, and one device buffer, both
sized once for the largest step. The runner writes a step into the host arrays through numpy views,
then `upload` copies the used prefixes with non-blocking copies that queue behind the previous
step's kernels instead of synchronising. The device tensors never move, so that CUDA graphs
captured over them see each step's values. On the CPU the two are the same tensor.

A decode row whose input token was sampled by the step still in flight (async scheduling) gets a
placeholder in the host array; `fill_prev_token_ids` then copies the id from that step's samples
on the device, behind the upload and before the forward (graph replays read the same buffer).

Block tables are kept flat: a step with `num_rows` rows of `width` entries uses the first
`num_rows * width` elements, viewed as a contiguous [num_rows, width] tensor (what the kernels
take). Graphs use their own fixed width; eager steps use the batch's longest table.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tinyvllm.ops import AttentionMetadata


class _Pair:
    """A host tensor (pinned when the device is CUDA), its numpy view, and the device tensor."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=on_gpu)
        self.np = self.host.numpy()
        self.device = torch.zeros(size, dtype=dtype, device=device) if on_gpu else self.host

    def upload(self, n: int) -> None:
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)


class InputBuffers:
    """Host and device buffers for steps of up to `max_num_tokens` tokens and `max_num_seqs` rows.

    Shape (device tensors, the used prefix of each):
        input_ids, positions, slot_mapping: [num_tokens] int64
        query_start_loc: [num_rows + 1] int32
        seq_lens: [num_rows] int32
        block_tables: [num_rows * width] int32, viewed [num_rows, width]
        logits_indices: [num_sampled] int64
        prev_token_dst, prev_token_src: [num_prev_tokens] int64: input_ids positions to fill
            from the previous step's sampled ids, and the rows of those ids
    """

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device):
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = _Pair(max_num_tokens, torch.int64, device)
        self.positions = _Pair(max_num_tokens, torch.int64, device)
        self.slot_mapping = _Pair(max_num_tokens, torch.int64, device)
        self.query_start_loc = _Pair(max_num_seqs + 1, torch.int32, device)
        self.seq_lens = _Pair(max_num_seqs, torch.int32, device)
        self.block_tables = _Pair(max_num_seqs * max_blocks_per_seq, torch.int32, device)
        self.logits_indices = _Pair(max_num_seqs, torch.int64, device)
        self.prev_token_dst = _Pair(max_num_seqs, torch.int64, device)
        self.prev_token_src = _Pair(max_num_seqs, torch.int64, device)
        # Recorded after each upload: the host arrays may be rewritten once the copies have run.
        self._uploaded: Optional[torch.cuda.Event] = (
            torch.cuda.Event() if device.type == "cuda" else None)

    def wait_until_writable(self) -> None:
        """Block until the previous step's copies have read the host arrays.

        Usually free or short: the copies come first in the previous step's device work, which
        starts once the step before it is done, and the engine has usually waited for that one
        already (it processes a step's samples before launching the step after next).
        """
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def block_table_rows(self, num_rows: int, width: int) -> np.ndarray:
        """The host block tables as a writable [num_rows, width] view, zeroed (0 = null block)."""
        assert num_rows <= self.max_num_seqs and width <= self.max_blocks_per_seq, (num_rows, width)
        rows = self.block_tables.np[:num_rows * width].reshape(num_rows, width)
        rows.fill(0)
        return rows

    def upload(self, num_tokens: int, num_rows: int, width: int, num_sampled: int,
               num_prev_tokens: int = 0) -> None:
        """Queue the host-to-device copies of the used prefixes (non-blocking)."""
        for pair in (self.input_ids, self.positions, self.slot_mapping):
            pair.upload(num_tokens)
        self.query_start_loc.upload(num_rows + 1)
        self.seq_lens.upload(num_rows)
        self.block_tables.upload(num_rows * width)
        self.logits_indices.upload(num_sampled)
        if num_prev_tokens:
            self.prev_token_dst.upload(num_prev_tokens)
            self.prev_token_src.upload(num_prev_tokens)
        if self._uploaded is not None:
            self._uploaded.record()

    def fill_prev_token_ids(self, num_prev_tokens: int, prev_sampled: torch.Tensor) -> None:
        """input_ids[dst[i]] = prev_sampled[src[i]] for the first num_prev_tokens pairs, on the
        device stream after `upload` (which wrote placeholders there).

        Shape: prev_sampled [num_rows of the previous step] int64, on the buffers' device.
        """
        dst = self.prev_token_dst.device[:num_prev_tokens]
        src = self.prev_token_src.device[:num_prev_tokens]
        self.input_ids.device.index_copy_(0, dst, prev_sampled.index_select(0, src))

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


class BlockTableCache:
    """Each running request's block ids as an int32 array, grown as its list grows.

    `Request.block_ids` only ever grows while a request runs (a preempted request's list is emptied
    and refilled, and the runner drops its entry via `preempted_request_ids`), so a step converts
    only the new ids instead of the whole list. The first and last known ids are re-checked so
    that a list replaced behind our back is rebuilt rather than trusted.
    """

    def __init__(self) -> None:
        self._tables: dict[str, tuple[np.ndarray, int]] = {}

    def get(self, request_id: str, block_ids: list[int]) -> np.ndarray:
        """[len(block_ids)] int32, equal to block_ids."""
        n = len(block_ids)
        entry = self._tables.get(request_id)
        if entry is None or not _still_prefix(entry, block_ids):
            array = np.empty(max(n, 16), dtype=np.int32)
            array[:n] = block_ids
        else:
            array, filled = entry
            if n > len(array):
                array = np.concatenate([array[:filled], np.empty(max(n, 2 * len(array)) - filled,
                                                                 dtype=np.int32)])
            array[filled:n] = block_ids[filled:]
        self._tables[request_id] = (array, n)
        return array[:n]

    def drop(self, request_id: str) -> None:
        self._tables.pop(request_id, None)


def _still_prefix(entry: tuple[np.ndarray, int], block_ids: list[int]) -> bool:
    array, filled = entry
    if filled > len(block_ids):
        return False
    return filled == 0 or (array[0] == block_ids[0] and array[filled - 1] == block_ids[filled - 1])
