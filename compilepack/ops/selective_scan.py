"""``compilepack::selective_scan_varlen``: the Mamba1 selective scan, reset at every document start.

Layout of mamba-ssm's ``selective_scan_fn`` and transformers' ``mamba_selective_scan`` (Mamba, FalconMamba,
Jamba share it):

- ``u``, ``delta``, ``z``: ``[b, D, T]`` (transformers passes transposes of ``[b, T, D]`` projections);
- ``A``: ``[D, N]`` real (negative); ``D``, ``delta_bias``: ``[D]``;
- ``B``, ``C``: ``[b, N, T]``, or ``[b, G, N, T]`` with ``D % G == 0`` (channel ``d`` reads group
  ``d // (D // G)``);
- ``seq_idx``: ``int32 [b, T]`` document index of every token, non-decreasing along a row.

The recurrence, per channel ``d`` and state ``n``, is ``h_t = exp(dt_t A) h_(t-1) + dt_t B_t u_t`` and
``y_t = C_t . h_t + D u_t``, gated by ``silu(z_t)``. A document start multiplies the carried state by exactly 0
(``exp(dt A)`` is zeroed there), so every document starts from the zero state, as when it runs alone.

Reference (pure torch, any device): a two-level blocked scan instead of one Python step per token. Time is
cut into blocks of ``BLOCK`` tokens; one loop of ``BLOCK`` steps runs the recurrence inside every block at
once (each step one multiply-add over all blocks), a loop over blocks carries the block-end states
(``T / BLOCK`` small steps), and one multiply-add adds each carried state, decayed by the cumulative product
of ``exp(dt A)`` inside the block, to every token. Products of decays, never ratios or logarithms, so it is
exact with the zeroed decays and cannot overflow; it differs from a token-by-token scan only by rounding.
The backward is explicit: the same blocked scan run backwards in time gives the state gradient, from which
every input gradient is one contraction. The forward saves the states (``[b, T, D, N]``, the memory the stock
scan's autograd also keeps) and the pre-gate output.

CUDA: mamba-ssm's selective scan cannot reset inside a row. Read at state-spaces/mamba main e9594ce
(mamba-ssm 2.3.2.post1): ``selective_scan_cuda.fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus)`` and
``.bwd(...)`` take no ``seq_idx`` / ``cu_seqlens`` / position indices (the fused ``mamba_inner_fn`` neither);
document resets exist only in unmerged pull requests (#235 ``cu_seqlens``, #434 ``position_indices``), and since
#977 the CUDA selective scan is not even built by default. So this op runs the reference on every device,
whatever ``backend`` says, and never imports a kernel library.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 64  # tokens per block of the blocked scan (also the padding unit of the saved states)
EMPTY = (0,)  # shape of the placeholder returned for an absent optional gradient
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus is the identity above this (gradient 1)


def selective_scan_varlen(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    seq_idx: torch.Tensor | None = None,
    *,
    backend: str = "reference",
) -> torch.Tensor:
    """Mamba1 selective scan over packed documents; the state restarts at every document start.

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
        seq_idx: ``int32 [b, T]`` document index per token, non-decreasing along each row (the HF collator's
            ``seq_idx``); a document starts where it changes and at every row start. Required: without it
            the scan would run through document boundaries.
        backend: the CUDA library chosen by ``compilepack.patch``; accepted for the common op contract, but
            no library can reset the selective scan inside a row (see the module docstring), so the
            reference runs on every device.

    Returns:
        ``[b, D, T]``: the transpose of a contiguous ``[b, T, D]`` tensor (what the caller's
        ``out.transpose(1, 2)`` wants), in float32 (float64 for float64 ``u``), as transformers' torch scan
        computes and returns it.
    """
    _check_args(u, delta, A, B, C, D, z, delta_bias, seq_idx)
    B, C = (t.unsqueeze(1) if t.dim() == 3 else t for t in (B, C))
    out, _saved = torch.ops.compilepack.selective_scan_varlen(
        u, delta, A, B, C, seq_idx.to(torch.int32), D, z, delta_bias, bool(delta_softplus), backend
    )
    return out


# ----------------------------------------------------------------------------------------------- checks


def _fail(argument: str, expected: str, got) -> None:
    raise ValueError(f"selective_scan_varlen: {argument} must be {expected}, got {got}.")


def _check_args(u, delta, A, B, C, D, z, delta_bias, seq_idx) -> None:
    """Errors a caller can fix, from shapes and dtypes only (static facts, safe to trace)."""
    if seq_idx is None:
        raise ValueError(
            "selective_scan_varlen: seq_idx=None would scan the whole row as one sequence; pass the "
            "collator's seq_idx (int32 [b, T], document index per token)."
        )
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
    if seq_idx.shape != (batch, total):
        _fail("seq_idx", f"[b, T] = {(batch, total)}", tuple(seq_idx.shape))
    if seq_idx.dtype not in (torch.int32, torch.int64):
        _fail("seq_idx", "an int32 (or int64) tensor of document indices", seq_idx.dtype)
    for name, tensor in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        if not tensor.is_floating_point():
            _fail(name, "a real floating-point tensor", tensor.dtype)


# ----------------------------------------------------------------------------------------------- custom ops


def _compute_dtype(u: torch.Tensor) -> torch.dtype:
    """float32 like transformers' torch scan (float64 stays float64, for exactness tests)."""
    return torch.promote_types(u.dtype, torch.float32)


def _padded_length(total):
    """Token count rounded up to whole blocks (works on symbolic sizes)."""
    return (total + BLOCK - 1) // BLOCK * BLOCK


def _new_channel_last(like: torch.Tensor, batch, dim, total, dtype) -> torch.Tensor:
    """``[b, D, T]`` with the strides of the transpose of a contiguous ``[b, T, D]``."""
    return like.new_empty_strided((batch, dim, total), (total * dim, 1, dim), dtype=dtype)


@torch.library.custom_op("compilepack::selective_scan_varlen", mutates_args=())
def _scan_fwd_op(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    seq_idx: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    backend: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Returns ``(out, [states, pre_gate])``: the states ``h`` (flat ``[b, T_blocks, D, N]``) and the output
    before the gate (flat ``[b, T, D]``; empty without ``z``) feed the backward. ``B``, ``C`` are
    ``[b, G, N, T]`` here; ``backend`` is unused (no library resets inside a row)."""
    return _reference_forward(u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus)


@_scan_fwd_op.register_fake
def _(u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus, backend):
    batch, dim, total = u.shape
    dtype = _compute_dtype(u)
    out = _new_channel_last(u, batch, dim, total, dtype)
    states = u.new_empty(batch * _padded_length(total) * dim * A.shape[1], dtype=dtype)
    pre_gate = u.new_empty(batch * total * dim, dtype=dtype) if z is not None else u.new_empty(EMPTY, dtype=dtype)
    return out, [states, pre_gate]


@torch.library.custom_op("compilepack::selective_scan_varlen_backward", mutates_args=())
def _scan_bwd_op(
    grad_out: torch.Tensor,
    saved: list[torch.Tensor],
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    seq_idx: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """Returns ``(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)``, each laid out as its input
    (``torch.empty_like``) in the input's dtype; an empty placeholder for an absent ``D`` / ``z`` /
    ``delta_bias``."""
    grads = _reference_backward(grad_out, saved, u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus)
    return tuple(
        u.new_empty(EMPTY) if tensor is None else torch.empty_like(tensor).copy_(grad)
        for grad, tensor in zip(grads, (u, delta, A, B, C, D, z, delta_bias))
    )


@_scan_bwd_op.register_fake
def _(grad_out, saved, u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus, backend):
    return tuple(
        u.new_empty(EMPTY) if t is None else torch.empty_like(t) for t in (u, delta, A, B, C, D, z, delta_bias)
    )


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus, backend = inputs
    _out, saved = output
    ctx.save_for_backward(u, delta, A, B, C, seq_idx, D, z, delta_bias, *saved)
    ctx.statics = (delta_softplus, backend)


def _backward(ctx, grad_out, _grad_saved):
    u, delta, A, B, C, seq_idx, D, z, delta_bias, *saved = ctx.saved_tensors
    du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = torch.ops.compilepack.selective_scan_varlen_backward(
        grad_out, saved, u, delta, A, B, C, seq_idx, D, z, delta_bias, *ctx.statics
    )
    present = lambda grad, tensor: None if tensor is None else grad  # noqa: E731
    return (du, ddelta, dA, dB, dC, None, present(dD, D), present(dz, z), present(ddelta_bias, delta_bias),
            None, None)


_scan_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- reference


def _pad_time(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) to whole blocks: padded tokens have dt = 0 (decay 1, no input) and get no
    output gradient, so they change nothing before them."""
    return t.contiguous() if pad == 0 else F.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad))


class _Inputs:
    """One scan's inputs in the reference's token-major layout, padded to whole blocks.

    ``dt``, ``u``: ``[b, Tp, D]``; ``B``, ``C``: ``[b, Tp, G, N]``; ``keep``: ``[b, Tp]``, False where a token
    starts a document (its decay is zeroed); ``dt_biased``: ``[b, T, D]``, the softplus input.
    """

    def __init__(self, u, delta, A, B, C, seq_idx, delta_bias, delta_softplus):
        dtype = _compute_dtype(u)
        self.batch, self.dim, self.total = u.shape
        self.groups, self.state = B.shape[1], B.shape[2]
        self.padded = _padded_length(self.total)
        pad = self.padded - self.total
        dt = delta.to(dtype).transpose(1, 2)
        self.dt_biased = dt if delta_bias is None else dt + delta_bias.to(dtype)
        dt = F.softplus(self.dt_biased) if delta_softplus else self.dt_biased
        self.dt = _pad_time(dt, pad)
        self.u = _pad_time(u.to(dtype).transpose(1, 2), pad)
        self.B = _pad_time(B.to(dtype).permute(0, 3, 1, 2), pad)
        self.C = _pad_time(C.to(dtype).permute(0, 3, 1, 2), pad)
        self.A = A.to(dtype)
        same_doc = seq_idx[:, 1:] == seq_idx[:, :-1]
        self.keep = F.pad(same_doc, (1, pad), value=False)

    def grouped(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, Tp, D, ...]`` -> ``[b, Tp, G, D // G, ...]``."""
        return t.view(t.shape[0], t.shape[1], self.groups, self.dim // self.groups, *t.shape[3:])

    def decay(self) -> torch.Tensor:
        """``a = exp(dt A)`` ``[b, Tp, D, N]``, exactly 0 at document starts."""
        a = torch.mul(self.dt[..., None], self.A).exp_()
        return a.mul_(self.keep[:, :, None, None])

    def scan_input(self) -> torch.Tensor:
        """``dt * u * B`` ``[b, Tp, D, N]`` (a fresh buffer: the forward scan runs in place on it)."""
        return (self.grouped(self.dt * self.u)[..., None] * self.B[:, :, :, None]).flatten(2, 3).contiguous()


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """``[b, Tp, ...]`` -> ``[b, Tp // BLOCK, BLOCK, ...]`` (a view)."""
    return t.view(t.shape[0], t.shape[1] // BLOCK, BLOCK, *t.shape[2:])


def _scan_forward_(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """In place: ``x[t] <- a[t] * x[t-1] + x[t]`` along dim 1 (from ``x[-1] = 0``); returns x."""
    xb, ab = _blocks(x), _blocks(a)
    for step in range(1, BLOCK):  # every block at once, each from a zero state
        xb[:, :, step].addcmul_(ab[:, :, step], xb[:, :, step - 1])
    nblocks = xb.shape[1]
    if nblocks > 1:
        decay_in_block = torch.cumprod(ab[:, 1:], dim=2)  # from each block's start to each of its tokens
        carried = [xb[:, 0, -1]]  # the true state at the end of each block, from the first
        for block in range(1, nblocks - 1):
            carried.append(torch.addcmul(xb[:, block, -1], decay_in_block[:, block - 1, -1], carried[-1]))
        xb[:, 1:].addcmul_(decay_in_block, torch.stack(carried, dim=1)[:, :, None])
    return x


def _scan_backward_(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """In place, the transpose of :func:`_scan_forward_`: ``g[t] <- g[t] + a[t+1] * g[t+1]`` backwards
    along dim 1 (from ``g[Tp] = 0``); returns g."""
    gb, ab = _blocks(g), _blocks(a)
    nblocks = gb.shape[1]
    # decay_to_end[:, c, l] = a[c, l+1] * ... * a[c, BLOCK-1]: from token l to the end of block c (not needed
    # for the last block, which receives nothing from a later one)
    decay_to_end = torch.empty_like(ab[:, :-1])
    if nblocks > 1:
        decay_to_end[:, :, -1] = 1
    for step in range(BLOCK - 2, -1, -1):
        gb[:, :, step].addcmul_(ab[:, :, step + 1], gb[:, :, step + 1])
        if nblocks > 1:
            torch.mul(ab[:, :-1, step + 1], decay_to_end[:, :, step + 1], out=decay_to_end[:, :, step])
    if nblocks > 1:
        # incoming[c] = a[c+1, 0] * g_true[c+1, 0]: what block c's last token receives from the next block
        incoming = [gb[:, -1, 0] * ab[:, -1, 0]]
        for block in range(nblocks - 2, 0, -1):
            start = torch.addcmul(gb[:, block, 0], decay_to_end[:, block, 0], incoming[-1])
            incoming.append(start * ab[:, block, 0])
        gb[:, :-1].addcmul_(decay_to_end, torch.stack(incoming[::-1], dim=1)[:, :, None])
    return g


def _skip_and_gate(y, u, D, z):
    """``(pre_gate, out)``: ``pre_gate = y + D u`` and ``out = pre_gate * silu(z)`` (all ``[b, T, D]``)."""
    pre_gate = y if D is None else torch.addcmul(y, u, D.to(y.dtype))
    out = pre_gate if z is None else pre_gate * F.silu(z.to(y.dtype).transpose(1, 2))
    return pre_gate, out


def _reference_forward(u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus):
    k = _Inputs(u, delta, A, B, C, seq_idx, delta_bias, delta_softplus)
    states = _scan_forward_(k.scan_input(), k.decay())  # [b, Tp, D, N]
    y = torch.einsum("btgjn,btgn->btgj", k.grouped(states), k.C).flatten(2)[:, : k.total]
    pre_gate, out = _skip_and_gate(y, k.u[:, : k.total], D, z)
    # only the gate's gradient reads the pre-gate output (and without a gate it would alias the output)
    pre_gate = pre_gate.contiguous().view(-1) if z is not None else pre_gate.new_empty(EMPTY)
    return out.transpose(1, 2), [states.view(-1), pre_gate]


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(x)
    return sig * (1 + x * (1 - sig))


def _reference_backward(grad_out, saved, u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus):
    """Hand-derived gradients of :func:`_reference_forward`, ``[b, T, ...]`` layouts; ``dB``/``dC`` are
    ``[b, G, N, T]`` views.

    With ``a_t = exp(dt_t A)`` (0 at document starts), ``h_t = a_t h_(t-1) + dt_t B_t u_t`` and
    ``y_t = C_t . h_t``: the state gradient ``g_t = C_t dy_t + a_(t+1) g_(t+1)`` is the transposed scan;
    then ``d(dt_t A) = g_t a_t h_(t-1)``, and the input term ``dt_t B_t u_t`` receives ``g_t``.
    """
    k = _Inputs(u, delta, A, B, C, seq_idx, delta_bias, delta_softplus)
    states_flat, pre_gate_flat = saved
    states = states_flat.view(k.batch, k.padded, k.dim, k.state)
    dtype = states.dtype
    grad = grad_out.to(dtype).transpose(1, 2)  # [b, T, D]

    dz = None
    if z is not None:
        z_t = z.to(dtype).transpose(1, 2)
        dz = grad * pre_gate_flat.view(k.batch, k.total, k.dim) * _silu_grad(z_t)
        grad = grad * F.silu(z_t)
    u_t = k.u[:, : k.total]
    dD = None if D is None else (grad * u_t).sum((0, 1))
    dy = _pad_time(grad, k.padded - k.total)

    dC = torch.einsum("btgjn,btgj->btgn", k.grouped(states), k.grouped(dy))
    g = _scan_backward_((k.grouped(dy)[..., None] * k.C[:, :, :, None]).flatten(2, 3), a := k.decay())

    # d(dt A)_t = g_t a_t h_(t-1), zero at t = 0 (no earlier state)
    d_log_decay = torch.zeros_like(g)
    torch.mul(g[:, 1:], a[:, 1:], out=d_log_decay[:, 1:]).mul_(states[:, :-1])
    dA = torch.einsum("btdn,btd->dn", d_log_decay, k.dt)
    ddt = torch.einsum("btdn,dn->btd", d_log_decay, k.A)

    # the input term dt * u * B
    g_dot_B = torch.einsum("btgjn,btgn->btgj", k.grouped(g), k.B).flatten(2)
    dB = torch.einsum("btgjn,btgj->btgn", k.grouped(g), k.grouped(k.dt * k.u))
    ddt += g_dot_B * k.u
    du = g_dot_B * k.dt

    du, ddt = du[:, : k.total], ddt[:, : k.total]
    if D is not None:
        du = du + grad * D.to(dtype)
    if delta_softplus:
        ddt = ddt * torch.where(k.dt_biased > SOFTPLUS_THRESHOLD, 1.0, torch.sigmoid(k.dt_biased))
    ddelta_bias = None if delta_bias is None else ddt.sum((0, 1))
    to_BT = lambda t: t[:, : k.total].permute(0, 2, 3, 1)  # noqa: E731  [b, Tp, G, N] -> [b, G, N, T]
    return (du.transpose(1, 2), ddt.transpose(1, 2), dA, to_BT(dB), to_BT(dC), dD,
            None if dz is None else dz.transpose(1, 2), ddelta_bias)
