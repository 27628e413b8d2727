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



def segmented_cumsum(x: Tensor, same_doc: Tensor, tokens_dim: int = -1) -> Tensor:
    """Cumulative sum over a chunk's tokens that restarts at every document start: ``out_i = sum_{j <= i, same doc} x_j``.

    ``x`` is chunks first, ``[NC, ..., C]`` (``tokens_dim=-1``) or ``[NC, ..., C, K]`` (``tokens_dim=-2``, one sum
    per channel); ``same_doc`` is the ``[NC, C, C]`` lower-triangular same-document mask (True on the diagonal).
    A masked matrix product, not a difference of plain cumsums: other documents' terms enter only as exact
    zeros, so a document's sums do not depend on its neighbours' values, not even by rounding.
    """
    return _masked_sum(x, same_doc, tokens_dim)


def segmented_cumsum_backward(grad: Tensor, same_doc: Tensor, tokens_dim: int = -1) -> Tensor:
    """Gradient of :func:`segmented_cumsum`: the reverse cumulative sum, restarting at every document end."""
    return _masked_sum(grad, same_doc.transpose(-1, -2), tokens_dim)


def _masked_sum(x: Tensor, mask_NCC: Tensor, tokens_dim: int) -> Tensor:
    ones = x.dim() - (2 if tokens_dim == -1 else 3)  # x's dims between the chunk dim and the token dim
    mask = mask_NCC.to(x.dtype).view(mask_NCC.shape[0], *(1,) * ones, *mask_NCC.shape[1:])
    if tokens_dim == -2:
        return mask @ x
    return (mask @ x.unsqueeze(-1)).squeeze(-1)


def compute_dtype(x: Tensor) -> torch.dtype:
    """What the references compute in: float32 at least (as transformers and the kernels accumulate); float64
    inputs stay float64, so fp64 gradchecks test the exact formulas."""
    return torch.promote_types(x.dtype, torch.float32)


def check_delta_rule_inputs(q, k, v, g, beta, cu_seqlens, per_channel_decay: bool) -> None:
    """Shape and dtype checks of a delta-rule op's inputs (``g`` is ``[B, T, HV]``, or ``[B, T, HV, K]`` with a
    per-channel decay). Nothing here reads tensor data, so it traces without guards on values."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, heads, head_dim], got shape {tuple(x.shape)}.")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [B, T, H, K], got {tuple(k.shape)}.")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T = {tuple(q.shape[:2])}, got {tuple(v.shape)}.")
    if v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"v's head count HV={v.shape[2]} must be a multiple of q's H={q.shape[2]}.")
    g_shape, g_text = (v.shape[:3], "[B, T, HV]") if not per_channel_decay else ((*v.shape[:3], q.shape[3]), "[B, T, HV, K]")
    if g.shape != g_shape:
        raise ValueError(f"g must be {g_text} = {tuple(g_shape)}, got {tuple(g.shape)}.")
    if beta.shape != v.shape[:3]:
        raise ValueError(f"beta must be [B, T, HV] = {tuple(v.shape[:3])}, got {tuple(beta.shape)}.")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {x.dtype}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor [N+1], got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}."
        )
