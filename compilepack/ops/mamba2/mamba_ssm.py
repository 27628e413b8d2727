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

Long rows: every release computes the SSD kernels' pointer offsets in int32 (Triton specialises the program ids and
strides as i32), so past 2**31 elements an offset wraps, silently or into an illegal access (mamba #1015, the
fixes #1033-#1038 closed or open, none released). The offsets stay below the element count of the tensor they
index, so a call runs the library only while every tensor its forward and backward allocate or read (T rounded up
to whole chunks) holds fewer than 2**31 elements (:func:`fits_int32_offsets`); a larger one runs compilepack's
reference, on the same device, with the same output layout. Decided from shapes inside the op: no host sync.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import backends
from .._scaffold import Path
from . import reference

SSD_COMBINED = "mamba_ssm.ops.triton.ssd_combined"  # the module holding the SSD forward/backward functions
INT32_ELEMENTS = 2**31  # a tensor the kernels index with this many elements or more can wrap their offsets


def fits_int32_offsets(x, B, chunk_size: int) -> bool:
    """Whether every tensor ``mamba_chunk_scan_combined`` and its backward index stays under 2**31 elements.

    Read in mamba-ssm 2.3.2.post1 (``ssd_chunk_state.py``, ``ssd_chunk_scan.py``, ``ssd_combined.py``): x, out, dx
    ``[b, T, H, P]`` (and dD, smaller); the chunk states and their gradients ``[b, nc, H, P, N]``; ``CB`` ``[b, nc,
    G, cs, cs]`` and its gradient ``[b, nc, splits, G, cs, cs]``; dB, dC ``[b, T, splits, G, N]``; ddA_cumsum ``[b,
    H, nc, cs/16, cs]`` (smaller than the gradient of CB at its widest split)."""
    batch, _, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    chunks = -(-x.shape[1] // chunk_size)
    tokens, splits = chunks * chunk_size, _head_splits(x, chunks, heads, groups)
    largest = max(
        batch * tokens * heads * head_dim,
        batch * chunks * heads * head_dim * state,
        batch * tokens * splits * groups * max(chunk_size, state),
    )
    return largest < INT32_ELEMENTS


def _head_splits(x, chunks: int, heads: int, groups: int) -> int:
    """The backward's split of each group's heads (``nsplits`` in ``_chunk_state_bwd_db`` and
    ``_chunk_scan_bwd_dcb``): from the device's SM count, as the library computes it; at most ``H / G``, the bound
    taken off CUDA (a host property, no sync)."""
    per_group = heads // groups
    if x.device.type != "cuda":
        return per_group
    sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
    per_program = max(min(math.ceil(x.shape[0] * chunks * heads / sm_count), per_group), 1)
    return -(-per_group // per_program)


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    if not fits_int32_offsets(x, B, chunk_size):
        y, _ = reference.forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
        return y.to(x.dtype), []
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
    if not fits_int32_offsets(x, B, chunk_size):  # the reference's backward, from its own forward (recomputed)
        inputs = (x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
        y_reference, saved_reference = reference.forward(*inputs)
        return reference.backward(grad_y, y_reference, saved_reference, needs_grad, *inputs)
    ssd = backends.load(SSD_COMBINED)
    dx, ddt, dA, dB, dC, dD, _dz, ddt_bias, _dinitial = ssd._mamba_chunk_scan_combined_bwd(
        grad_y.to(y.dtype).contiguous(), x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(),
        C.contiguous(), y, chunk_size, D=_contiguous(D), z=None, dt_bias=_contiguous(dt_bias),
        initial_states=None, dfinal_states=None, seq_idx=seq_idx.to(torch.int32).contiguous(),
        dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
    )
    return dx, ddt, dA, dB, dC, dD, ddt_bias


PATH = Path(forward=forward, backward=backward, fake=fake)


# ------------------------------------------------------------------------------------------------ with a state
#
# ``compilepack::mamba2_chunk_scan_varlen_state``: the scan from a zero state, each row's final state and ``alpha``
# (see ``reference.py``). The library gives the first two (``return_final_states``; its backward takes
# ``dfinal_states``); no initial state is handed to it: in mamba-ssm 2.3.2.post1 an initial state reaches only the
# tokens whose ``seq_idx`` is 0 (``ssd_state_passing.py`` starts its comparison from id 0, ``ssd_chunk_scan.py``
# reads the previous id as 0 before the first chunk, and the backward carries nothing into ``dinitial_states`` unless
# the first chunk's last id is 0), while a rank's slice starts with any document id; the incoming state is added by
# the caller through ``alpha`` instead. ``alpha`` is ``[b, T, H]``, computed here in torch, its gradient written out.


def _processed_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, dtype):
    """``(dt processed as the kernel does it: bias, softplus, clamp; its derivative in the raw dt)`` in ``dtype``."""
    biased = dt.to(dtype) if dt_bias is None else dt.to(dtype) + dt_bias.to(dtype)
    activated = F.softplus(biased) if dt_softplus else biased
    slope = torch.sigmoid(biased).masked_fill(biased > 20, 1) if dt_softplus else torch.ones_like(biased)
    inside = (activated >= dt_min) & (activated <= dt_max)  # clamped values get no gradient
    return activated.clamp(min=dt_min, max=dt_max), slope * inside


def _first_document_decay(dt_processed, A, seq_idx):
    """``(first [b, T, 1], alpha [b, T, H])``: each row's first-document tokens, and the product of ``exp(dt_s A)``
    from the row's start to each of them (0 elsewhere)."""
    first = (seq_idx == seq_idx[:, :1])[..., None]
    log_decay = torch.where(first, dt_processed * A.to(dt_processed.dtype), 0)
    return first, log_decay.cumsum(1).masked_fill(~first, -torch.inf).exp()


def _alpha_grads(d_alpha, dt, A, seq_idx, dt_bias, dt_softplus, dt_min, dt_max, dtype):
    """``alpha``'s share of the gradients of dt, A and dt_bias. Explicit: a custom op's body runs below autograd.
    alpha = exp(cumsum of the first document's log decays dt_s A): each log decay gets the sum of the later
    d_alpha * alpha."""
    dt_processed, slope = _processed_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, dtype)
    first, alpha = _first_document_decay(dt_processed, A, seq_idx)
    d_log_decay = torch.where(first, (d_alpha.to(dtype) * alpha).flip(1).cumsum(1).flip(1), 0)
    d_dt = d_log_decay * A.to(dtype) * slope
    d_A = (d_log_decay * dt_processed).sum((0, 1))
    return d_dt, d_A, None if dt_bias is None else d_dt.sum((0, 1))


def forward_state(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    if not fits_int32_offsets(x, B, chunk_size):
        *outs, _ = reference.forward_state(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min,
                                           dt_max)
        return (*outs, [])
    ssd = backends.load(SSD_COMBINED)
    dtype = reference.scan_dtype(x, dt, A, B, C)
    y, final = ssd.mamba_chunk_scan_combined(
        x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(), chunk_size,
        D=_contiguous(D), z=None, dt_bias=_contiguous(dt_bias), seq_idx=seq_idx.to(torch.int32).contiguous(),
        dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max), return_final_states=True,
    )
    _, alpha = _first_document_decay(_processed_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, dtype)[0], A, seq_idx)
    return y.to(dtype), final.to(dtype).contiguous(), alpha, []


def fake_state(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    *outs, _ = reference.fake_state(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    return (*outs, [])


def backward_state(grad_y, d_final, d_alpha, out, saved, needs_grad, x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size,
                   dt_softplus, dt_min, dt_max):
    inputs = (x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    if not fits_int32_offsets(x, B, chunk_size):  # the reference's backward, from its own forward (recomputed)
        y, *_, saved_reference = reference.forward_state(*inputs)
        return reference.backward_state(grad_y, d_final, d_alpha, y, saved_reference, needs_grad, *inputs)
    ssd = backends.load(SSD_COMBINED)
    dx, ddt, dA, dB, dC, dD, _dz, ddt_bias, _dinitial = ssd._mamba_chunk_scan_combined_bwd(
        grad_y.to(x.dtype).contiguous(), x.contiguous(), dt.contiguous(), A.contiguous(),
        # ``out``: without a gate z the library reads only its shape (2.3.2.post1), so x stands in: nothing is saved
        B.contiguous(), C.contiguous(), x, chunk_size, D=_contiguous(D), z=None, dt_bias=_contiguous(dt_bias),
        initial_states=None, dfinal_states=d_final.float().contiguous(),
        seq_idx=seq_idx.to(torch.int32).contiguous(), dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
    )
    dtype = reference.scan_dtype(x, dt, A, B, C)
    ddt_alpha, dA_alpha, ddt_bias_alpha = _alpha_grads(d_alpha, dt, A, seq_idx, dt_bias, dt_softplus, dt_min, dt_max,
                                                       dtype)
    ddt = ddt + ddt_alpha
    dA = dA + dA_alpha
    ddt_bias = None if dt_bias is None else ddt_bias + ddt_bias_alpha
    return dx, ddt, dA, dB, dC, dD, ddt_bias


PATH_STATE = Path(forward=forward_state, backward=backward_state, fake=fake_state)
