"""The causal conv one document at a time: slow, obviously right, the tests' oracle.

Each document (a run of equal ``seq_idx`` within a row) is convolved alone: ``F.conv1d`` with ``W-1`` zeros of
left padding, depthwise (``groups=D``), then silu if asked. Computes in the inputs' dtype (pass float64 for an
exact answer); differentiable by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d_naive(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor, activation: str | None = None
) -> Tensor:
    """Same arguments and values as :func:`compilepack.ops.causal_conv1d_varlen` (no backend); the result is a
    contiguous ``[B, D, T]``."""
    dim, width = weight.shape
    rows = []
    for x_DT, ids in zip(x, seq_idx.tolist()):
        starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]] + [len(ids)]
        documents = [
            F.conv1d(F.pad(x_DT[None, :, start:end], (width - 1, 0)), weight[:, None], bias, groups=dim)
            for start, end in zip(starts[:-1], starts[1:])
        ]
        rows.append(torch.cat(documents, dim=2) if documents else x_DT[None])
    out = torch.cat(rows)
    return F.silu(out) if activation is not None else out
