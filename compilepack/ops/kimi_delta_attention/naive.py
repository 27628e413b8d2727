"""Kimi delta attention, token by token, one document at a time: slow, obviously right, the tests' oracle.

Per value head, with ``S`` the ``K x V`` state, zero at every document start, and ``g_t`` a K-vector:
``S <- diag(exp(g_t)) S`` (row c of S decays by ``exp(g_t[c])``);  ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``;
``o_t = S^T (scale q_t)``. q and k are L2-normalised first when asked (eps 1e-6, as transformers and fla); each
q/k head serves ``HV // H`` consecutive value heads. Computes in the inputs' dtype (pass float64 for an exact
answer); differentiable by autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._chunked import L2NORM_EPS


def kimi_delta_attention_naive(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, use_qk_l2norm: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Same arguments and result as :func:`compilepack.ops.kimi_delta_attention_varlen` (no backend)."""
    out_shape, group = v.shape, v.shape[2] // q.shape[2]
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2NORM_EPS)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2NORM_EPS)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    q, k = (x.flatten(0, 1).repeat_interleave(group, dim=1) for x in (q, k))  # [B*T, HV, K]
    v, g, beta = (x.flatten(0, 1) for x in (v, g, beta))
    bounds = cu_seqlens.tolist()
    pieces = [_document(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces).reshape(out_shape)


def _document(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One document, ``[L, HV, ...]`` per token, from a zero state: ``[L, HV, V]``."""
    state = v.new_zeros(v.shape[1], k.shape[-1], v.shape[-1])  # [HV, K, V]
    outputs = []
    for q_t, k_t, v_t, g_t, beta_t in zip(q, k, v, g, beta):
        state = g_t.exp().unsqueeze(-1) * state  # row c of each head's state decays by exp(g_t[c])
        error = v_t - (k_t.unsqueeze(-1) * state).sum(-2)  # v_t - S^T k_t: [HV, V]
        state = state + k_t.unsqueeze(-1) * (beta_t.unsqueeze(-1) * error).unsqueeze(-2)
        outputs.append((q_t.unsqueeze(-1) * state).sum(-2))
    return torch.stack(outputs) if outputs else v.new_zeros(0, *v.shape[1:])
