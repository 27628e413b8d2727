"""``compilepack::selective_scan_varlen``: the Mamba1 selective scan (Mamba, FalconMamba, Jamba) on packed rows.
The state restarts from zero at every document start, so a packed row gives each document exactly the output it
gets when run alone.

Layout of mamba-ssm's ``selective_scan_fn`` and transformers' ``mamba_selective_scan``:

- ``u``, ``delta``, ``z``: ``[b, D, T]`` (transformers passes transposes of ``[b, T, D]`` projections);
- ``A``: ``[D, N]`` real (negative); ``D``, ``delta_bias``: ``[D]``;
- ``B``, ``C``: ``[b, N, T]``, or ``[b, G, N, T]`` with ``D % G == 0`` (channel ``d`` reads group
  ``d // (D // G)``);
- ``seq_idx``: ``int32 [b, T]`` document index of every token, non-decreasing along a row;
- the output: ``[b, D, T]``, the transpose of a contiguous ``[b, T, D]`` (what the caller's
  ``out.transpose(1, 2)`` wants).

The recurrence, per channel ``d`` and state ``n``, is ``h_t = exp(dt_t A) h_(t-1) + dt_t B_t u_t`` and
``y_t = C_t . h_t + D u_t``, gated by ``silu(z_t)``. A document start multiplies the carried state by exactly 0.

- ``reference.py``: a blocked scan in pure torch with an explicit backward: what runs on every device;
- ``naive.py``: the token-by-token recurrence per document, the tests' oracle.

No kernel path: mamba-ssm's selective scan cannot reset inside a row. Read at state-spaces/mamba main e9594ce
(mamba-ssm 2.3.2.post1): ``selective_scan_cuda.fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus)`` and
``.bwd(...)`` take no ``seq_idx`` / ``cu_seqlens`` / position indices (the fused ``mamba_inner_fn`` neither);
document resets exist only in unmerged pull requests (#235 ``cu_seqlens``, #434 ``position_indices``), and since
#977 the CUDA selective scan is not even built by default. So this op runs the reference whatever ``backend``
says, and never imports a kernel library.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import backends
from .._scaffold import define_op
from . import reference
from .naive import selective_scan_naive

__all__ = ["selective_scan_naive", "selective_scan_varlen"]


def selective_scan_varlen(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, z: Tensor | None = None,
    delta_bias: Tensor | None = None, delta_softplus: bool = False, *, seq_idx: Tensor,
    backend: str = backends.REFERENCE,
) -> Tensor:
    """Mamba1 selective scan over packed documents; the state is zero at every document start.

    Args:
        u: ``[b, D, T]`` input (any strides; transformers passes the transpose of a ``[b, T, D]`` tensor).
        delta: ``[b, D, T]`` raw time steps; processed as transformers does: ``delta + delta_bias``, then
            softplus if ``delta_softplus``.
        A: ``[D, N]`` real decay rates (``-exp(A_log)``).
        B: ``[b, N, T]`` or grouped ``[b, G, N, T]`` (``D % G == 0``) input projections.
        C: the shape of ``B``; output projections.
        D: ``[D]`` skip connection, or None.
        z: ``[b, D, T]`` gate (the output is multiplied by ``silu(z)``), or None.
        delta_bias: ``[D]``, or None.
        delta_softplus: apply softplus to ``delta + delta_bias``.
        seq_idx: ``int32`` (or ``int64``) ``[b, T]`` document index per token, non-decreasing along each row (the
            collator's ``seq_idx``): a document starts where it changes, and at every row start.
        backend: the CUDA library chosen by ``compilepack.patch``; accepted for the common op contract, but no
            library can reset the selective scan inside a row (see the module docstring), so the reference runs
            on every device.

    Returns:
        ``[b, D, T]``: the transpose of a contiguous ``[b, T, D]`` tensor, in float32 (float64 if ``u`` is
        float64), as transformers' torch scan computes and returns it.
    """
    _check_inputs(u, delta, A, B, C, D, z, delta_bias, seq_idx)
    B, C = (t.unsqueeze(1) if t.dim() == 3 else t for t in (B, C))
    out, _ = OP(u, delta, A, B, C, seq_idx.to(torch.int32), D, z, delta_bias, bool(delta_softplus), backend)
    return out


def _fail(argument: str, expected: str, got) -> None:
    raise ValueError(f"selective_scan_varlen: {argument} must be {expected}, got {got}.")


def _check_inputs(u, delta, A, B, C, D, z, delta_bias, seq_idx) -> None:
    """Errors a caller can fix, from shapes and dtypes only (static facts, safe to trace)."""
    if u.dim() != 3:
        _fail("u", "[b, D, T]", tuple(u.shape))
    batch, dim, total = u.shape
    if delta.shape != u.shape:
        _fail("delta", f"[b, D, T] = {tuple(u.shape)}", tuple(delta.shape))
    if A.dim() != 2 or A.shape[0] != dim:
        _fail("A", f"[D, N] with D = {dim} (a real tensor; time-invariant complex A is not supported)",
              tuple(A.shape))
    state = A.shape[1]
    if B.dim() not in (3, 4) or B.shape[0] != batch or B.shape[-2:] != (state, total) or (
        B.dim() == 4 and dim % B.shape[1] != 0
    ):
        _fail("B", f"[b, N, T] or [b, G, N, T] with b, N, T = {(batch, state, total)} and D = {dim} a multiple "
              "of G (time-invariant [D, N] B is not supported)", tuple(B.shape))
    if C.shape != B.shape:
        _fail("C", f"the shape of B {tuple(B.shape)}", tuple(C.shape))
    if D is not None and D.shape != (dim,):
        _fail("D", f"[D] = {(dim,)}", tuple(D.shape))
    if z is not None and z.shape != u.shape:
        _fail("z", f"[b, D, T] = {tuple(u.shape)}", tuple(z.shape))
    if delta_bias is not None and delta_bias.shape != (dim,):
        _fail("delta_bias", f"[D] = {(dim,)}", tuple(delta_bias.shape))
    if not isinstance(seq_idx, Tensor) or seq_idx.dtype not in (torch.int32, torch.int64):
        _fail("seq_idx", "an int32 (or int64) tensor of document indices",
              seq_idx.dtype if isinstance(seq_idx, Tensor) else repr(seq_idx))
    if seq_idx.shape != (batch, total):
        _fail("seq_idx", f"[b, T] = {(batch, total)}", tuple(seq_idx.shape))
    for name, tensor in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        if not tensor.is_floating_point():
            _fail(name, "a real floating-point tensor", tensor.dtype)


def _signature(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, seq_idx: Tensor, D: Tensor | None,
    z: Tensor | None, delta_bias: Tensor | None, delta_softplus: bool, backend: str,
): ...


OP = define_op(
    "compilepack::selective_scan_varlen",
    signature=_signature,
    differentiable=("u", "delta", "A", "B", "C", "D", "z", "delta_bias"),
    reference=reference.PATH,
    kernels={},  # no library resets the scan inside a row: the reference runs on every device
    boundaries=("seq_idx",),
)
