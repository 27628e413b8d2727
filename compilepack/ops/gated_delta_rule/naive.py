"""The gated delta rule, token by token, one document at a time: slow, obviously right, the tests' oracle.

Per value head, with ``S`` the ``K x V`` state, zero at every document start:
``S <- exp(g_t) S``;  ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``;  ``o_t = S^T (scale q_t)``.
q and k are L2-normalised first when asked (eps 1e-6, as transformers and fla). Computes in the inputs' dtype
(pass float64 for an exact answer); differentiable by autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._chunked import L2NORM_EPS


def gated_delta_rule_naive(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Same arguments and result as :func:`compilepack.ops.gated_delta_rule_varlen` (no backend)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q, k))
    # each q/k head serves HV // H consecutive value heads
    q, k = (x.repeat_interleave(HV // H, dim=2).reshape(B * T, HV, K) for x in (q, k))
    v, g, beta = v.reshape(B * T, HV, -1), g.reshape(B * T, HV), beta.reshape(B * T, HV)
    outputs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        state = v.new_zeros(HV, K, v.shape[-1])
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
            state = state + torch.einsum("hk,hv->hkv", k[t], delta)
            outputs.append(torch.einsum("hkv,hk->hv", state, q[t] * scale))
    return torch.stack(outputs).reshape(B, T, HV, -1)
