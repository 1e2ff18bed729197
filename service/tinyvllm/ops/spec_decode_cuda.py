"""The CUDA acceptance-sampling kernel (`cuda/spec_decode.cuh`) behind
`ops.spec_decode.rejection_sample`."""

from __future__ import annotations

from typing import Optional

import torch

from tinyvllm.ops._dispatch import stream_handle
from tinyvllm.ops.spec_decode import PLACEHOLDER_TOKEN_ID


def rejection_sample_cuda(kernel, target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                          cu_num_draft: torch.Tensor, draft_probs: Optional[torch.Tensor],
                          noise: Optional[torch.Tensor], uniform: Optional[torch.Tensor],
                          seed: Optional[torch.Tensor], offset: Optional[torch.Tensor]
                          ) -> torch.Tensor:
    """Shapes as `ops.spec_decode.rejection_sample`. Reads max_k on the host for the output
    width (a sync); the engine reads the result on the host right after anyway."""
    device = target_probs.device
    num_reqs = cu_num_draft.numel() - 1
    num_draft_tokens = draft_token_ids.numel()
    _check("target_probs", target_probs, torch.float32, (num_draft_tokens + num_reqs, None), device)
    vocab_size = target_probs.shape[1]
    _check("draft_token_ids", draft_token_ids, torch.int64, (num_draft_tokens,), device)
    _check("cu_num_draft", cu_num_draft, torch.int64, (num_reqs + 1,), device)
    if draft_probs is not None:
        _check("draft_probs", draft_probs, torch.float32, (num_draft_tokens, vocab_size), device)
    if noise is not None:
        _check("noise", noise, torch.float32, tuple(target_probs.shape), device)
    if uniform is not None:
        _check("uniform", uniform, torch.float32, (num_draft_tokens,), device)
    if noise is None and (seed is None or offset is None):
        raise ValueError("seed, offset: required when no noise tensor is given")
    for name, t in (("seed", seed), ("offset", offset)):
        if t is not None:
            _check(name, t, torch.int64, (num_reqs,), device)
    if draft_probs is not None and noise is not None and uniform is None:
        raise ValueError("uniform: required with draft_probs when noise is given")
    max_k = int((cu_num_draft[1:] - cu_num_draft[:-1]).max()) if num_reqs else 0
    out = torch.full((num_reqs, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                     device=device)
    kernel.rejection_sample(out=out.data_ptr(), out_stride=max_k + 1,
                            target_probs=target_probs.data_ptr(),
                            draft_probs=_ptr(draft_probs),
                            draft_token_ids=draft_token_ids.data_ptr(),
                            cu_num_draft=cu_num_draft.data_ptr(), num_reqs=num_reqs,
                            vocab_size=vocab_size, noise=_ptr(noise), uniform=_ptr(uniform),
                            seed=_ptr(seed), offset=_ptr(offset), stream=stream_handle(device))
    return out


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, device) -> None:
    """t is contiguous, of dtype, on device, with the shape (None: any size there)."""
    ok = (t.dtype == dtype and t.is_contiguous() and t.device == device and t.dim() == len(shape)
          and all(want is None or got == want for got, want in zip(t.shape, shape)))
    if not ok:
        raise ValueError(f"{name}: expected contiguous {dtype} {shape} on {device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
