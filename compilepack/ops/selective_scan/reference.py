"""The Mamba1 selective scan's fast pure-torch path (any device; fp32 compute, fp64 stays fp64): a blocked scan.

Layout inside: token-major, ``[b, T, D, N]`` states; the op's ``[b, D, T]`` inputs are transposed on entry and
``B``, ``C`` arrive as ``[b, G, N, T]``.

Time is cut into blocks of ``BLOCK`` tokens; one loop of ``BLOCK`` steps runs the recurrence inside every block at
once (each step one multiply-add over all blocks), a loop over blocks carries the block-end states (``T / BLOCK``
small steps), and one multiply-add adds each carried state, decayed by the cumulative product of ``exp(dt A)``
inside the block, to every token. Products of decays, never ratios or logarithms, so it cannot overflow, and a
document start, where the decay is exactly 0, cuts every chain of products through it: another document's
state enters a token only as ``0 * state``, an exact zero added before any rounding can carry it (bit-exact
isolation). It differs from a token-by-token scan only by rounding.

The backward is explicit: the same blocked scan run backwards in time gives the state gradient, from which every
input gradient is one contraction per token. The forward saves the states (``[b, T, D, N]``, the memory the stock
scan's autograd also keeps) and the pre-gate output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._chunked import compute_dtype
from .._scaffold import Path

BLOCK = 64  # tokens per block of the blocked scan (also the padding unit of the saved states)
EMPTY = (0,)  # shape of the saved pre-gate output when there is no gate
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus is the identity above this (gradient 1)


def forward(u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus):
    """``(out, [states, pre_gate])``: the states ``h`` (flat ``[b, T_blocks, D, N]``) and the output before the
    gate (flat ``[b, T, D]``; empty without ``z``) feed the backward. ``out`` is ``[b, D, T]``, the transpose of a
    contiguous ``[b, T, D]``."""
    k = _Inputs(u, delta, A, B, C, seq_idx, delta_bias, delta_softplus)
    states = _scan_forward_(k.scan_input(), k.decay())  # [b, Tp, D, N]
    y = torch.einsum("btgjn,btgn->btgj", k.grouped(states), k.C).flatten(2)[:, : k.total]
    pre_gate, out = _skip_and_gate(y, k.u[:, : k.total], D, z)
    # only the gate's gradient reads the pre-gate output (and without a gate it would alias the output)
    pre_gate = pre_gate.contiguous().view(-1) if z is not None else pre_gate.new_empty(EMPTY)
    # contiguous: without D and z, y is a slice of the block-padded buffer (batch stride Tp * D, not T * D)
    return out.contiguous().transpose(1, 2), [states.view(-1), pre_gate]


def fake(u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus):
    """What :func:`forward` returns, as empty tensors."""
    batch, dim, total = u.shape
    dtype = compute_dtype(u)
    out = u.new_empty_strided((batch, dim, total), (total * dim, 1, dim), dtype=dtype)
    states = u.new_empty(batch * _padded_length(total) * dim * A.shape[1], dtype=dtype)
    pre_gate = u.new_empty(batch * total * dim if z is not None else EMPTY, dtype=dtype)
    return out, [states, pre_gate]


def backward(grad_out, out, saved, needs_grad, u, delta, A, B, C, seq_idx, D, z, delta_bias, delta_softplus):
    """Hand-derived gradients of :func:`forward`: ``(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)`` (None for an
    absent input), ``dB``/``dC`` ``[b, G, N, T]`` views.

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


PATH = Path(forward=forward, backward=backward, fake=fake)


def _padded_length(total):
    """Token count rounded up to whole blocks (works on symbolic sizes)."""
    return (total + BLOCK - 1) // BLOCK * BLOCK


def _pad_time(t: Tensor, pad: int) -> Tensor:
    """Zero-pad dim 1 (time) to whole blocks: padded tokens have dt = 0 (decay 1, no input) and get no
    output gradient, so they change nothing before them."""
    return t.contiguous() if pad == 0 else F.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad))


class _Inputs:
    """One scan's inputs in the reference's token-major layout, padded to whole blocks.

    ``dt``, ``u``: ``[b, Tp, D]``; ``B``, ``C``: ``[b, Tp, G, N]``; ``keep``: ``[b, Tp]``, False where a token
    starts a document (its decay is zeroed); ``dt_biased``: ``[b, T, D]``, the softplus input.
    """

    def __init__(self, u, delta, A, B, C, seq_idx, delta_bias, delta_softplus):
        dtype = compute_dtype(u)
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

    def grouped(self, t: Tensor) -> Tensor:
        """``[b, Tp, D, ...]`` -> ``[b, Tp, G, D // G, ...]``."""
        return t.view(t.shape[0], t.shape[1], self.groups, self.dim // self.groups, *t.shape[3:])

    def decay(self) -> Tensor:
        """``a = exp(dt A)`` ``[b, Tp, D, N]``, exactly 0 at document starts."""
        a = torch.mul(self.dt[..., None], self.A).exp_()
        return a.mul_(self.keep[:, :, None, None])

    def scan_input(self) -> Tensor:
        """``dt * u * B`` ``[b, Tp, D, N]`` (a fresh buffer: the forward scan runs in place on it)."""
        return (self.grouped(self.dt * self.u)[..., None] * self.B[:, :, :, None]).flatten(2, 3).contiguous()


def _blocks(t: Tensor) -> Tensor:
    """``[b, Tp, ...]`` -> ``[b, Tp // BLOCK, BLOCK, ...]`` (a view)."""
    return t.view(t.shape[0], t.shape[1] // BLOCK, BLOCK, *t.shape[2:])


def _scan_forward_(x: Tensor, a: Tensor) -> Tensor:
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


def _scan_backward_(g: Tensor, a: Tensor) -> Tensor:
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


def _silu_grad(x: Tensor) -> Tensor:
    sig = torch.sigmoid(x)
    return sig * (1 + x * (1 - sig))


