"""Varlen attention, one document at a time over the plain math: slow, obviously right, the tests' oracle.

Per document and query head: ``scores = q k^T * scale``; a query may see a key when (causal) the key is not later
and (sliding window ``w``, as transformers counts it) the two are fewer than ``w`` tokens apart, so a causal query
sees itself and ``w - 1`` earlier tokens; ``out = softmax(scores) v``. Grouped-query attention repeats every
key/value head for its ``H // Hkv`` query heads. Computes in the inputs' dtype (pass float64 for an exact answer);
differentiable by autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor


def attention_naive(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, causal: bool = True, scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """Same arguments and result as :func:`compilepack.ops.varlen_attention`, without ``max_seqlen`` and the
    backend (``v``'s head dim may differ from ``q``'s)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    outputs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_d = q[start:end].transpose(0, 1)  # [H, L, D]
        k_d, v_d = (x[start:end].repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))
        scores = (q_d @ k_d.transpose(-1, -2)) * scale
        position = torch.arange(end - start, device=q.device)
        distance = position[:, None] - position[None, :]  # query position - key position
        allowed = torch.ones_like(distance, dtype=torch.bool)
        if causal:
            allowed &= distance >= 0
        if window is not None:
            allowed &= distance.abs() < window
        probs = scores.masked_fill(~allowed, -torch.inf).softmax(dim=-1)
        outputs.append((probs @ v_d).transpose(0, 1))
    return torch.cat(outputs)
