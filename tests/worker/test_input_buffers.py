"""InputBuffers: the packed layout of a step's inputs and the in-flight token fill (CPU)."""

from __future__ import annotations

import torch

from tinyvllm.worker.input_buffers import InputBuffers

CPU = torch.device("cpu")


def test_sections_are_aligned_disjoint_and_fixed_by_shape():
    b = InputBuffers(64, 8, 16, CPU)
    b.begin(5, 3, 4)
    names = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
             "block_tables", "logits_indices", "prev_token_dst", "prev_token_src")
    spans = []
    for name in names:
        t = getattr(b, name).device
        start = t.data_ptr()
        assert start % 16 == 0, name
        spans.append((start, start + t.numel() * t.element_size(), name))
    # logits_indices: one per token (a speculative request has a logits row per position)
    assert [len(getattr(b, n).np) for n in names] == [5, 5, 5, 4, 3, 12, 5, 3, 3]
    for (_, end, name), (start, _, _) in zip(spans, spans[1:]):
        assert end <= start, name  # back to back, no overlap
    first = [getattr(b, n).device.data_ptr() for n in names]
    b.begin(7, 2, 9)  # another shape moves them ...
    b.begin(5, 3, 4)  # ... and the same shape puts them back (what a captured graph reads)
    assert [getattr(b, n).device.data_ptr() for n in names] == first


def test_fill_prev_token_ids_run_and_gather():
    b = InputBuffers(16, 8, 4, CPU)
    prev = torch.tensor([100, 101, 102, 103])
    b.begin(6, 6, 1)
    b.input_ids.np[:6] = [1, 2, 3, 4, 5, 6]
    b.prev_token_dst.np[:3], b.prev_token_src.np[:3] = [2, 3, 4], [1, 2, 3]  # runs: one copy
    b.fill_prev_token_ids(3, prev)
    assert b.input_ids.device[:6].tolist() == [1, 2, 101, 102, 103, 6]
    b.prev_token_dst.np[:3], b.prev_token_src.np[:3] = [5, 0, 3], [0, 3, 3]  # a gather
    b.fill_prev_token_ids(3, prev)
    assert b.input_ids.device[:6].tolist() == [103, 2, 101, 103, 103, 100]
