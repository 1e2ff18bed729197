"""Speculative decoding's acceptance (rejection) sampling: the torch reference (the CPU path) and
the door to the CUDA kernel (`cuda/spec_decode.cuh`).

Layout: B requests; request b proposed k_b draft tokens and the target computed k_b + 1
positions (its last token and the k_b drafts), so

    draft_token_ids   [N]                 N = sum k_b, request-major
    cu_num_draft      [B + 1]             prefix sums of k_b
    target_probs      [T, vocab_size]     T = N + B; request b's rows start at cu_num_draft[b] + b
    draft_probs       [N, vocab_size]     or None: the drafts are deterministic (q one-hot)
    out               [B, max_k + 1]      emitted tokens, PLACEHOLDER_TOKEN_ID after the last

p are the target's distributions after temperature / top-k / top-p / min-p (one-hot at the
argmax for greedy rows), q the draft's. For each request, draft position j in order:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
    at the first rejection emit the recovered token ~ normalize(max(p_j - q_j, 0)) and stop;
    all k_b accepted: emit the bonus token ~ p_{k_b}.

The emitted tokens are distributed as sampling from p one token at a time. Noise: per target row
an Exp(1) vector E, and per draft position a uniform u. Tokens are drawn by the exponential race
argmax(w / E) (a sample from normalize(w)), as `ops.sampling` samples.

Deterministic drafts (q one-hot at d) take a coupling of the same rule: with t = argmax(p / E),
accept iff t == d (probability p(d)), and on rejection emit t, which given t != d is distributed
as p without d, normalized = normalize(max(p - q, 0)). t is exactly the token that the plain
sampler draws from p with the same noise, so with the noise keyed by the token's index in the
output (seed, index), a request gives the same tokens with speculation on as off, and greedy rows
reduce to comparing the draft with the argmax.
"""

from __future__ import annotations

from typing import Optional

import torch

from tinyvllm.ops._dispatch import use_kernel

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     cu_num_draft: torch.Tensor, draft_probs: Optional[torch.Tensor] = None, *,
                     noise: Optional[torch.Tensor] = None,
                     uniform: Optional[torch.Tensor] = None,
                     seed: Optional[torch.Tensor] = None,
                     offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Emitted tokens of each request (see the module docstring for the layout and the rule).

    On CUDA the kernel runs; elsewhere the reference, which needs the explicit noise.

    Args:
        target_probs: [T, vocab_size] float32.
        draft_token_ids: [N] int64.
        cu_num_draft: [B + 1] int64.
        draft_probs: [N, vocab_size] float32, or None for deterministic drafts.
        noise: [T, vocab_size] float32 Exp(1) draws (the reference requires it; the kernel uses
            it when given instead of Philox).
        uniform: [N] float32 in [0, 1), needed with draft_probs (same rule as noise).
        seed, offset: [B] int64: the kernel's Philox key and the output index of request b's
            first target row (row j takes offset + j), as `ops.sampling.sample` keys its noise.
    Returns:
        [B, max_k + 1] int64, PLACEHOLDER_TOKEN_ID past each request's emitted tokens.
    """
    kernel = use_kernel("rejection_sample", target_probs)
    if kernel is not None:
        from tinyvllm.ops.spec_decode_cuda import rejection_sample_cuda
        return rejection_sample_cuda(kernel, target_probs, draft_token_ids, cu_num_draft,
                                     draft_probs, noise, uniform, seed, offset)
    if noise is None or (draft_probs is not None and uniform is None):
        raise ValueError("noise, uniform: the reference needs explicit Exp(1) noise (and "
                         "uniforms when draft_probs are given)")
    return rejection_sample_ref(target_probs, draft_token_ids, cu_num_draft, draft_probs,
                                noise, uniform)


def rejection_sample_ref(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                         cu_num_draft: torch.Tensor, draft_probs: Optional[torch.Tensor],
                         noise: torch.Tensor, uniform: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch reference of `rejection_sample`, vectorised over all positions (no loop)."""
    device = target_probs.device
    num_reqs = cu_num_draft.numel() - 1
    num_draft = cu_num_draft[1:] - cu_num_draft[:-1]  # [B]
    req = torch.repeat_interleave(torch.arange(num_reqs, device=device), num_draft)  # [N]
    pos = torch.arange(req.numel(), device=device) - cu_num_draft[:-1][req]  # [N] j in request
    draft_rows = torch.arange(req.numel(), device=device) + req  # [N] target row of d_j
    bonus_rows = cu_num_draft[1:] + torch.arange(num_reqs, device=device)  # [B]
    tiny = torch.finfo(noise.dtype).tiny
    race = (target_probs / noise.clamp_min(tiny)).argmax(dim=-1)  # [T]
    accepted, recovered = _judge(target_probs, draft_token_ids, draft_probs, noise, uniform,
                                 race, draft_rows, tiny)
    # First rejected position per request (k_b when none): everything before it is accepted.
    first_reject = num_draft.clone()
    first_reject.scatter_reduce_(0, req[~accepted], pos[~accepted], reduce="amin")
    max_k = int(num_draft.max()) if num_reqs else 0
    out = torch.full((num_reqs, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                     device=device)
    keep = pos < first_reject[req]
    out[req[keep], pos[keep]] = draft_token_ids[keep]
    final = race[bonus_rows]
    rejected = first_reject < num_draft
    reject_index = (cu_num_draft[:-1] + first_reject)[rejected]
    final[rejected] = recovered[reject_index]
    out[torch.arange(num_reqs, device=device), first_reject] = final
    return out


def _judge(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
           draft_probs: Optional[torch.Tensor], noise: torch.Tensor,
           uniform: Optional[torch.Tensor], race: torch.Tensor, draft_rows: torch.Tensor,
           tiny: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draft position: accepted [N] bool and the token emitted if it is the first rejection
    [N] int64."""
    if draft_probs is None:  # the coupling of the module docstring
        return race[draft_rows] == draft_token_ids, race[draft_rows]
    p = target_probs[draft_rows]  # [N, vocab_size]
    d = draft_token_ids.unsqueeze(1)
    # u < p / q with u in [0, 1): probability min(1, p / q).
    accepted = uniform * draft_probs.gather(1, d).squeeze(1) < p.gather(1, d).squeeze(1)
    # A rejection needs p(d) < q(d), which leaves positive mass in max(p - q, 0).
    residual = (p - draft_probs).clamp_min(0)
    recovered = (residual / noise[draft_rows].clamp_min(tiny)).argmax(dim=-1)
    return accepted, recovered
