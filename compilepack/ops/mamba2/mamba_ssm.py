"""The Mamba2 SSD scan on CUDA through mamba-ssm's own Triton forward and backward.

Read in state-spaces/mamba at e9594ce (mamba-ssm 2.3.2.post1), ``mamba_ssm/ops/triton/ssd_combined.py``:

- ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, ...)`` is the
  public forward; ``_mamba_chunk_scan_combined_bwd(dout, x, dt, A, B, C, out, chunk_size, D=, z=, dt_bias=,
  initial_states=, dfinal_states=, seq_idx=, dt_softplus=, dt_limit=)`` is what its autograd Function calls and
  returns ``(dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states)`` with dA / ddt_bias in float32;
- the Triton kernels take strides, but B, C, D and dout must have ``stride(-1) == 1`` and x ``stride(-1)`` or
  ``stride(1) == 1``; seq_idx is read as an int32 ``[b, T]`` tensor (equality of neighbours marks a reset); the
  output is allocated as ``x.dtype``.

We pass every tensor contiguous, seq_idx int32, ints and floats as Python values. Nothing is saved beyond the
output: the library's backward rebuilds its chunk states itself.
"""

from __future__ import annotations

import torch

from ... import backends
from .._scaffold import Path

SSD_COMBINED = "mamba_ssm.ops.triton.ssd_combined"  # the module holding the SSD forward/backward functions


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    ssd = backends.load(SSD_COMBINED)
    y = ssd.mamba_chunk_scan_combined(
        x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(), chunk_size,
        D=_contiguous(D), z=None, dt_bias=_contiguous(dt_bias), seq_idx=seq_idx.to(torch.int32).contiguous(),
        dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
    )
    return y, []


def fake(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    return x.new_empty(x.shape), []


def backward(grad_y, y, saved, needs_grad, x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min,
             dt_max):
    ssd = backends.load(SSD_COMBINED)
    dx, ddt, dA, dB, dC, dD, _dz, ddt_bias, _dinitial = ssd._mamba_chunk_scan_combined_bwd(
        grad_y.to(y.dtype).contiguous(), x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(),
        C.contiguous(), y, chunk_size, D=_contiguous(D), z=None, dt_bias=_contiguous(dt_bias),
        initial_states=None, dfinal_states=None, seq_idx=seq_idx.to(torch.int32).contiguous(),
        dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
    )
    return dx, ddt, dA, dB, dC, dD, ddt_bias


PATH = Path(forward=forward, backward=backward, fake=fake)
