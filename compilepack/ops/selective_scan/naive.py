"""The Mamba1 selective scan, token by token, one document at a time: slow, obviously right, the tests' oracle.

Per channel ``d`` and state ``n``, with ``h`` zero at every document start (every change of ``seq_idx`` along a
row, and every row start): ``dt_t = softplus?(delta_t + delta_bias)``;  ``h <- exp(dt_t A) h + dt_t B_t u_t``;
``y_t = C_t . h + D u_t``;  ``y_t *= silu(z_t)``, with ``B_t``, ``C_t`` the channel's group. Computes in the inputs'
(promoted) dtype (pass float64 for an exact answer); differentiable by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def selective_scan_naive(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, z: Tensor | None = None,
    delta_bias: Tensor | None = None, delta_softplus: bool = False, *, seq_idx: Tensor,
) -> Tensor:
    """Same arguments and result as :func:`compilepack.ops.selective_scan.selective_scan_varlen` (no backend),
    in the inputs' dtype."""
    tensors = [t for t in (u, delta, A, B, C, D, z, delta_bias) if t is not None]
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    u, delta, A, B, C = (t.to(dtype) for t in (u, delta, A, B, C))
    batch, dim, total = u.shape
    # channel d reads group d // (D // G): [b, G, N, T] -> [b, D, N, T]
    B, C = (t.unsqueeze(1) if t.dim() == 3 else t for t in (B, C))
    B, C = (t.repeat_interleave(dim // t.shape[1], dim=1) for t in (B, C))
    dt = delta if delta_bias is None else delta + delta_bias.to(dtype)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    rows = []
    for row in range(batch):
        ids = seq_idx[row].tolist()
        outputs = []
        for t in range(total):
            if t == 0 or ids[t] != ids[t - 1]:  # a document starts: the state restarts from zero
                state = u.new_zeros(dim, A.shape[1])
            step = dt[row, :, t, None]  # [D, 1]
            state = (step * A).exp() * state + step * B[row, :, :, t] * u[row, :, t, None]
            y = (C[row, :, :, t] * state).sum(-1)
            if D is not None:
                y = y + D.to(dtype) * u[row, :, t]
            if z is not None:
                y = y * F.silu(z[row, :, t].to(dtype))
            outputs.append(y)
        rows.append(torch.stack(outputs, dim=-1))
    return torch.stack(rows)
