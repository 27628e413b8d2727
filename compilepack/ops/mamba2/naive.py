"""The Mamba2 SSD scan, token by token, one document at a time: slow, obviously right, the tests' oracle.

Per head, with ``h`` the ``P x N`` state, zero at every document start (every change of ``seq_idx`` along a row,
and every row start): ``dt_t = clamp(softplus?(dt_t + dt_bias))``;  ``h <- exp(dt_t A) h + dt_t x_t B_t^T``;
``y_t = h C_t + D x_t``, with ``B_t``, ``C_t`` the head's group. Computes in the inputs' (promoted) dtype (pass
float64 for an exact answer); differentiable by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def mamba2_chunk_scan_naive(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, dt_bias: Tensor | None = None,
    dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")), *, seq_idx: Tensor,
) -> Tensor:
    """Same arguments and result as :func:`compilepack.ops.mamba2.mamba2_chunk_scan_varlen` (no chunk size, no
    backend)."""
    tensors = [t for t in (x, dt, A, B, C, D, dt_bias) if t is not None]
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    batch, total, heads, head_dim = x.shape
    # head h reads group h // (H // G)
    B, C = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))  # [b, T, H, N]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    decay = (dt * A).exp()  # [b, T, H]
    write = torch.einsum("bth,bthp,bthn->bthpn", dt, x, B)  # dt_t x_t B_t^T
    states = []
    for row in range(batch):
        ids = seq_idx[row].tolist()
        decays, writes = decay[row, :, :, None, None].unbind(0), write[row].unbind(0)  # per token
        for t in range(total):
            if t == 0 or ids[t] != ids[t - 1]:  # a document starts: the state restarts from zero
                state = x.new_zeros(heads, head_dim, B.shape[-1])
            state = decays[t] * state + writes[t]
            states.append(state)
    y = torch.einsum("bthpn,bthn->bthp", torch.stack(states).view(*write.shape), C)
    if D is not None:
        D = D.to(dtype)
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    return y
