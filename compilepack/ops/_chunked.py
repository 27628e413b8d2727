"""Helpers shared by the chunked delta-rule references (gated delta rule, Kimi delta attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

L2NORM_EPS = 1e-6  # transformers' l2norm and fla's l2norm_fwd use the same eps


def to_chunks(x_TD: Tensor, n_chunks: int, chunk: int) -> Tensor:
    """``[T, heads..., D]`` tokens (zero-padded to ``n_chunks * chunk``) -> ``[NC, heads..., C, D]`` contiguous."""
    pad = n_chunks * chunk - x_TD.shape[0]
    x_TD = F.pad(x_TD, (0, 0) * (x_TD.dim() - 1) + (0, pad))
    x = x_TD.reshape(n_chunks, chunk, *x_TD.shape[1:])
    return x.movedim(1, -2).contiguous()


def from_chunks(x: Tensor, total: int) -> Tensor:
    """Inverse of ``to_chunks``: ``[NC, heads..., C, D]`` -> ``[total, heads..., D]`` contiguous, no padding."""
    x = x.movedim(-2, 1)
    return x.reshape(-1, *x.shape[2:])[:total].contiguous()  # one chunk: reshape is a strided view


def l2norm(x: Tensor, enabled: bool) -> tuple[Tensor, Tensor | None]:
    """``x / sqrt(|x|^2 + eps)`` over the last dim, and the reciprocal norm (None when disabled)."""
    if not enabled:
        return x, None
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    return x * rstd, rstd


def l2norm_backward(dy: Tensor, y: Tensor, rstd: Tensor | None) -> Tensor:
    if rstd is None:
        return dy
    return rstd * (dy - (dy * y).sum(-1, keepdim=True) * y)
