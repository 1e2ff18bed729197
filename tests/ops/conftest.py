"""Shared inputs of the ops tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tinyvllm.ops.layers import build_cos_sin_cache


@pytest.fixture
def rotary_case() -> SimpleNamespace:
    """A small CPU batch for the rotary + cache-write references: t tokens of h query and hkv KV
    heads of size d as views into one qkv row, positions, slots (two of them padding) and a
    rotary table; the cache has 2 blocks of 16 slots."""
    torch.manual_seed(0)
    t, h, hkv, d = 7, 6, 2, 16
    qkv = torch.randn(t, (h + 2 * hkv) * d)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    return SimpleNamespace(t=t, hkv=hkv, d=d, q=q, k=k, v=v,
                           positions=torch.randint(0, 100, (t,)),
                           slots=torch.tensor([3, -1, 0, 17, 9, -1, 30]),
                           cos_sin=build_cos_sin_cache(d, 128, 10000.0, None))
