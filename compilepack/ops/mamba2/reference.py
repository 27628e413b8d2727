"""The Mamba2 SSD chunk scan's fast pure-torch path (any device, fp32 compute; fp64 stays fp64): masked chunks.

transformers' chunked SSD algorithm (``mamba2_chunk_scan``) with document masks, all from ``seq_idx`` equality
(the test mamba-ssm's kernels use, so both backends agree token for token). Per chunk:

1. inside a chunk, a token reads only earlier tokens of its own document (the intra-chunk decay);
2. a chunk's state is written only by the tokens of the document its last token belongs to;
3. the state carried from chunk ``k`` to chunk ``c`` survives only if their last tokens share a document;
4. a token reads the carried-in state only if it continues the document of the previous chunk's last token.

Every sum of log decays restarts at document starts and is a direct masked sum, never a difference of sums
that run through another document; masks go into exponents (-inf) or are exact zero factors applied before
any sum. A document's output and gradients therefore do not depend on any other document's values, not even
by rounding. The log decays are summed directly (not as differences of cumsums), as transformers'
``segment_sum`` does, which also keeps long chunks with strong decay precise.

The backward is explicit: the forward saves the per-chunk states and the intra-chunk decay; the backward
transposes each einsum in turn and sends every log-decay gradient back through the same masked sums.

Index names (as in the einsums): b batch row, c and k chunks, l and s positions in a chunk, g group, j head in
its group (head ``h = g * J + j``), p head dim, n state dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._chunked import compute_dtype
from .._scaffold import Path


def scan_dtype(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> torch.dtype:
    """What the reference computes in and returns: float32 at least, as transformers' scan (which upcasts
    x, dt, B and C); float64 if any of them is float64, so fp64 checks test the exact formulas."""
    dtype = compute_dtype(x)
    for t in (dt, A, B, C):
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _num_chunks(total, chunk_size: int):
    return (total + chunk_size - 1) // chunk_size


def _pad_time(t: Tensor, pad: int) -> Tensor:
    """Zero-pad dim 1 (time) to a whole number of chunks: padded tokens have dt = 0 (no decay, no input)."""
    if pad == 0:  # real ints here: op bodies are opaque to the compiler
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)


def _tril(size, device, diagonal: int = 0) -> Tensor:
    """Bool ``[size, size]``, True on and below the ``diagonal``-th diagonal. Compared, not ``ones().tril()``:
    CPU ``tril`` runs a parallel loop even on a 4 x 4 matrix, whose thread hand-offs cost milliseconds on busy
    cores."""
    position = torch.arange(size, device=device)
    return position[:, None] - position[None, :] >= -diagonal


def _segment_sum(a: Tensor, strict_lower: Tensor) -> Tensor:
    """``out[..., l, s] = sum_{s < k <= l} a[..., k]`` for ``s <= l`` (garbage above the diagonal, masked by the
    caller); ``strict_lower`` is ``_tril(size, -1)``. Summed directly: for ``s <= l`` only the terms between
    them enter (the others are exact zeros), so a same-document pair sums its own document's values only."""
    return torch.where(strict_lower, a[..., :, None], 0).cumsum(dim=-2)


def _segment_sum_backward(grad: Tensor, strict_lower: Tensor) -> Tensor:
    """Gradient of :func:`_segment_sum` for a ``grad`` that is zero above the diagonal:
    ``da[k] = sum_{l >= k} sum_{s < k} grad[l, s] = sum_{l > k-1} cumsum_s(grad)[l, k-1]``. Where ``grad`` is
    zero across documents, the rows of other documents add exact zeros."""
    below = torch.where(strict_lower, grad.cumsum(dim=-1), 0).sum(dim=-2)
    return F.pad(below[..., :-1], (1, 0))


class _Chunks:
    """One scan's inputs cut into chunks, with the document masks; shared by the forward and the backward.

    ``x``, ``x_dt``: ``[b, c, l, g, j, p]``; ``dt``: ``[b, c, l, H]``; ``B``, ``C``: ``[b, c, l, g, n]``;
    ``log_decay``, ``read_decay``: ``[b, c, H, l]``; ``same_doc``: ``[b, c, l, s]`` (same document and
    ``s <= l``); ``read``, ``write``: ``[b, c, 1, l]`` (token l continues the previous chunk's last document / is in
    the chunk's last document); ``keep_carry``: ``[b, c, k]`` (the state at the end of chunk k reaches the end of
    chunk c).
    """

    def __init__(self, x, dt, A, B, C, seq_idx, dt_bias, chunk_size, dt_softplus, dt_min, dt_max,
                 pad_continues: bool = False):
        dtype = scan_dtype(x, dt, A, B, C)
        batch, total, heads, head_dim = x.shape
        groups, state_size = B.shape[2], B.shape[3]
        self.total, self.heads, self.groups, self.chunk_size = total, heads, groups, chunk_size
        self.nchunks = _num_chunks(total, chunk_size)
        pad = self.nchunks * chunk_size - total
        chunks = (batch, self.nchunks, chunk_size)

        # dt processed as transformers does (bias, softplus, clamp), in the compute dtype as mamba-ssm does
        self.dt_biased = dt.to(dtype) if dt_bias is None else dt.to(dtype) + dt_bias.to(dtype)
        self.dt_activated = F.softplus(self.dt_biased) if dt_softplus else self.dt_biased
        dt_processed = torch.clamp(self.dt_activated, min=dt_min, max=dt_max)
        self.dt = _pad_time(dt_processed, pad).view(*chunks, heads)
        self.x = _pad_time(x.to(dtype), pad).view(*chunks, groups, heads // groups, head_dim)
        self.x_dt = self.x * self.dt.view(*chunks, groups, heads // groups, 1)
        self.B = _pad_time(B.to(dtype), pad).view(*chunks, groups, state_size)
        self.C = _pad_time(C.to(dtype), pad).view(*chunks, groups, state_size)
        self.A = A.to(dtype)
        self.log_decay = (self.dt * self.A).transpose(2, 3)  # [b, c, H, l]

        # padding tokens form a document of their own (x = dt = 0), so they never touch real tokens; or
        # (``pad_continues``) they continue the row's last document, whose state they leave exactly as it is (no
        # decay, no input), so the last chunk's end state is the state after the row's last token
        seq = torch.cat([seq_idx, (seq_idx[:, -1:] + (not pad_continues)).expand(batch, pad)], dim=1).view(chunks)
        last = seq[:, :, -1]
        # the document of the token before each chunk; chunk 0 continues none (no initial state)
        previous_last = torch.cat([seq[:, :1, 0] - 1, last[:, :-1]], dim=1)
        self.strict_lower = _tril(chunk_size, x.device, -1)
        self.same_doc = (seq[:, :, :, None] == seq[:, :, None, :]) & _tril(chunk_size, x.device)
        self.read = (seq == previous_last[:, :, None])[:, :, None]  # [b, c, 1, l]
        self.write = (seq == last[:, :, None])[:, :, None]
        self.chunks_strict_lower = _tril(self.nchunks, x.device, -1)
        self.keep_carry = (last[:, :, None] == last[:, None, :]) & _tril(self.nchunks, x.device)

        # decay from the chunk start to each token that reads the carried-in state: those tokens are a prefix of
        # the chunk (one document), so a cumsum of the log decays masked to them (exact zeros elsewhere, before
        # the sum) sums that document's values only
        read_log_decay = torch.where(self.read, self.log_decay, 0).cumsum(-1)
        self.read_decay = read_log_decay.masked_fill(~self.read, -torch.inf).exp()

    def heads_view(self, t: Tensor) -> Tensor:
        """``[b, c, H, ...]`` -> ``[b, c, g, j, ...]``."""
        return t.view(t.shape[0], t.shape[1], self.groups, self.heads // self.groups, *t.shape[3:])

    def intra_decay(self) -> Tensor:
        """``[b, c, H, l, s]``: the decay from token s to token l of the same document (0 elsewhere)."""
        log_decay = _segment_sum(self.log_decay, self.strict_lower)
        return log_decay.masked_fill_(~self.same_doc[:, :, None], -torch.inf).exp_()

    def intra_weights(self, decay: Tensor) -> tuple[Tensor, Tensor]:
        """``(CB, W)``: ``CB [b, c, g, l, s] = C_l . B_s``; ``W [b, c, g, j, l, s] = CB * decay``."""
        CB = torch.einsum("bclgn,bcsgn->bcgls", self.C, self.B)
        return CB, self.heads_view(decay) * CB[:, :, :, None]

    def carry_decay(self) -> Tensor:
        """``[b, H, c, k]``: decay from the end of chunk k to the end of chunk c (k <= c), 0 across documents.
        Only chunks wholly inside one document lie between a kept pair; each chunk's log decay is summed over
        its last document (the whole chunk for those), masked before the sum."""
        chunk_log_decay = torch.where(self.write, self.log_decay, 0).sum(-1).transpose(1, 2)  # [b, H, c]
        log_carry = _segment_sum(chunk_log_decay, self.chunks_strict_lower)
        return log_carry.masked_fill_(~self.keep_carry[:, None], -torch.inf).exp_()


def _token_major(t: Tensor) -> Tensor:
    """``[b, c, g, j, l]`` -> ``[b, c, l, g, j]``."""
    return t.permute(0, 1, 4, 2, 3)


def _heads_first(t: Tensor) -> Tensor:
    """``[b, c, l, g, j]`` -> ``[b, c, H, l]`` (contiguous: it is accumulated into)."""
    return t.flatten(3).transpose(2, 3).contiguous()


def _shift_chunks(end_states: Tensor) -> Tensor:
    """State at each chunk's start: the previous chunk's end state, zero for chunk 0 (no initial state)."""
    return torch.cat([torch.zeros_like(end_states[:, :1]), end_states[:, :-1]], dim=1)


def _skip(x: Tensor, D: Tensor) -> Tensor:
    """``D * x`` for ``D`` of shape ``[H]`` or ``[H, P]``."""
    return x * (D[:, None] if D.dim() == 1 else D)


def forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    """Masked SSD: ``(y [b, T, H, P], [chunk_states, end_states, decay])``, saved flat: the states
    ``[b, c, H, P, N]`` each chunk writes and at each chunk's end, and the intra-chunk decay."""
    k = _Chunks(x, dt, A, B, C, seq_idx, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    y, saved = _forward(k, x, D)
    # flat, so the chunk count is never a dimension of its own: the compiler specialises a size-1 dimension,
    # which would cost one recompile for every batch of at most one chunk
    return y, [t.contiguous().view(-1) for t in saved]


def _forward(k: _Chunks, x: Tensor, D: Tensor | None) -> tuple[Tensor, list[Tensor]]:
    decay = k.intra_decay()
    _CB, W = k.intra_weights(decay)
    y = torch.einsum("bcgjls,bcsgjp->bclgjp", W, k.x_dt)

    write_decay = decay[..., -1, :]  # from token s to the chunk end, 0 unless s is in the chunk's last document
    x_written = k.x_dt * _token_major(k.heads_view(write_decay))[..., None]
    chunk_states = torch.einsum("bclgn,bclgjp->bcgjpn", k.B, x_written).flatten(2, 3)
    end_states = torch.einsum("bhck,bkhpn->bchpn", k.carry_decay(), chunk_states)
    y_carried = torch.einsum("bclgn,bcgjpn->bclgjp", k.C, k.heads_view(_shift_chunks(end_states)))
    y = y + y_carried * _token_major(k.heads_view(k.read_decay))[..., None]

    y = y.reshape(x.shape[0], -1, *x.shape[2:])[:, : k.total]
    if D is not None:
        y = y + _skip(x.to(y.dtype), D.to(y.dtype))
    return y.contiguous(), [chunk_states, end_states, decay]


def fake(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    batch, total, heads, head_dim = x.shape
    dtype = scan_dtype(x, dt, A, B, C)
    nchunks = _num_chunks(total, chunk_size)
    states = batch * nchunks * heads * head_dim * B.shape[3]
    decay = batch * nchunks * heads * chunk_size * chunk_size
    saved = [x.new_empty(numel, dtype=dtype) for numel in (states, states, decay)]
    return x.new_empty(batch, total, heads, head_dim, dtype=dtype), saved


def backward(grad_y, y, saved, needs_grad, x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min,
             dt_max):
    """Hand-derived gradients of :func:`forward`, each einsum's transpose in turn; every log-decay gradient goes
    back through the masked sums it came from (the intra-chunk segment sum, the masked cumsum and chunk sums)."""
    k = _Chunks(x, dt, A, B, C, seq_idx, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    return _backward(k, grad_y, saved, x, B, D, dt_bias, dt_softplus, dt_min, dt_max)


def _backward(k: _Chunks, grad_y, saved, x, B, D, dt_bias, dt_softplus, dt_min, dt_max, d_final=None,
              d_log_decay_extra=None):
    """The gradients of :func:`forward`'s inputs; ``d_final``: that of the state at the end of every row's last
    chunk ``[b, H, P, N]``; ``d_log_decay_extra``: more gradient on each token's log decay ``[b, T, H]``."""
    chunk_size = k.chunk_size
    batch, heads, head_dim, state_size = x.shape[0], x.shape[2], x.shape[3], B.shape[3]
    states_shape = (batch, k.nchunks, heads, head_dim, state_size)
    chunk_states, end_states = saved[0].view(states_shape), saved[1].view(states_shape)
    decay = saved[2].view(batch, k.nchunks, heads, chunk_size, chunk_size)
    pad = k.nchunks * chunk_size - k.total
    dy = _pad_time(grad_y.to(k.x.dtype), pad).reshape(k.x.shape)

    # y += read_decay * (C . start_state)
    read = _token_major(k.heads_view(k.read_decay))
    dy_start = torch.einsum("bclgjp,bcgjpn->bclgjn", dy, k.heads_view(_shift_chunks(end_states)))
    d_read = torch.einsum("bclgjn,bclgn->bclgj", dy_start, k.C)
    dC = torch.einsum("bclgjn,bclgj->bclgn", dy_start, read)
    d_start = torch.einsum("bclgjp,bclgn->bcgjpn", dy * read[..., None], k.C).flatten(2, 3)
    d_read_log_decay = _heads_first(d_read * read)  # read_decay = exp(read_log_decay) where read

    # end_state[c] = sum_k carry_decay[c, k] * chunk_state[k]; carry_decay sums the chunks' log decays
    d_last = torch.zeros_like(d_start[:, :1]) if d_final is None else d_final[:, None].to(d_start.dtype)
    d_end = torch.cat([d_start[:, 1:], d_last], dim=1)
    carry = k.carry_decay()
    d_chunk_states = k.heads_view(torch.einsum("bhck,bchpn->bkhpn", carry, d_end))
    d_log_carry = torch.einsum("bchpn,bkhpn->bhck", d_end, chunk_states).mul_(carry)
    d_chunk_log_decay = _segment_sum_backward(d_log_carry, k.chunks_strict_lower).transpose(1, 2)  # [b, c, H]

    # chunk_state = sum_s B_s * write_decay_s * x_dt_s, write_decay = decay[-1, :]
    write = _token_major(k.heads_view(decay[..., -1, :]))
    B_d_states = torch.einsum("bclgn,bcgjpn->bclgjp", k.B, d_chunk_states)
    d_x_dt = B_d_states * write[..., None]
    dB = torch.einsum("bclgjp,bcgjpn->bclgn", k.x_dt * write[..., None], d_chunk_states)
    d_write = _heads_first((B_d_states * k.x_dt).sum(-1))

    # y = sum_s (CB * decay)[l, s] * x_dt_s inside the chunk
    CB, W = k.intra_weights(decay)
    d_x_dt += torch.einsum("bcgjls,bclgjp->bcsgjp", W, dy)
    d_W_decay = torch.einsum("bclgjp,bcsgjp->bcgjls", dy, k.x_dt).mul_(k.heads_view(decay))
    dCB = d_W_decay.sum(3)
    dC += torch.einsum("bcgls,bcsgn->bclgn", dCB, k.B)
    dB += torch.einsum("bcgls,bclgn->bcsgn", dCB, k.C)
    d_log_decay = d_W_decay.mul_(CB[:, :, :, None]).flatten(2, 3)  # [b, c, H, l, s]: through decay = exp(.)
    d_log_decay[..., -1, :] += d_write * decay[..., -1, :]  # the write decay is the decay matrix's last row
    d_log_decay = _segment_sum_backward(d_log_decay, k.strict_lower)
    # the masked cumsum (read) and the masked chunk sum (carry): reverse cumsum / broadcast, masked again
    d_log_decay += torch.where(k.read, d_read_log_decay.flip(-1).cumsum(-1).flip(-1), 0)
    d_log_decay += torch.where(k.write, d_chunk_log_decay[..., None], 0)

    # log_decay = dt * A
    d_log_decay = d_log_decay.transpose(2, 3)  # [b, c, l, H]
    if d_log_decay_extra is not None:
        d_log_decay = d_log_decay + _pad_time(d_log_decay_extra.to(d_log_decay.dtype), pad).view(d_log_decay.shape)
    dA = (d_log_decay * k.dt).sum((0, 1, 2))
    d_dt = d_log_decay * k.A + (d_x_dt * k.x).sum(-1).flatten(3)
    dx = d_x_dt * k.dt.view(*k.dt.shape[:3], k.groups, -1, 1)

    total = k.total
    dx = dx.reshape(batch, -1, heads, head_dim)[:, :total]
    d_dt = _dt_processing_backward(d_dt.reshape(batch, -1, heads)[:, :total], k, dt_softplus, dt_min, dt_max)
    dB, dC = (g.reshape(batch, -1, *B.shape[2:])[:, :total] for g in (dB, dC))
    dD = None
    if D is not None:
        grad = grad_y.to(dx.dtype)
        dx = dx + _skip(grad, D.to(dx.dtype))
        dD = (grad * x.to(dx.dtype)).sum((0, 1))
        dD = dD.sum(-1) if D.dim() == 1 else dD
    d_dt_bias = d_dt.sum((0, 1)) if dt_bias is not None else None
    return dx, d_dt, dA, dB, dC, dD, d_dt_bias


def _dt_processing_backward(d_dt: Tensor, k: _Chunks, dt_softplus: bool, dt_min: float, dt_max: float) -> Tensor:
    """Through the clamp (gradient passes where min <= dt <= max, as torch.clamp) and the softplus (identity
    above torch's threshold of 20)."""
    d_dt = d_dt * ((k.dt_activated >= dt_min) & (k.dt_activated <= dt_max))
    if dt_softplus:
        d_dt = d_dt * torch.where(k.dt_biased > 20.0, 1.0, torch.sigmoid(k.dt_biased))
    return d_dt


PATH = Path(forward=forward, backward=backward, fake=fake)


# ------------------------------------------------------------------------------------------------ with a state
#
# ``compilepack::mamba2_chunk_scan_varlen_state`` (context parallelism over tokens): the scan from a zero state, plus
# what a caller needs to add an incoming state without running it again. The state is affine in the incoming one:
# a row's first document carries an incoming ``h_in`` as ``alpha_t h_in`` to its token t, ``alpha_t`` the product
# of its decays ``exp(dt_s A)`` up to t (a per-head scalar), so ``y_t += alpha_t (h_in C_t)``; and the state after
# the row's last token is ``final + alpha_T h_in`` (``alpha_T`` 0 unless the row is one document).


def forward_state(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    """``(y, final_state, alpha, saved)`` in the compute dtype: ``y [b, T, H, P]`` (from a zero state), each row's
    state after its last token ``[b, H, P, N]`` and ``alpha [b, T, H]``, the decay from each row's start to each
    token of its first document (0 on the other tokens)."""
    k = _Chunks(x, dt, A, B, C, seq_idx, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, pad_continues=True)
    y, saved = _forward(k, x, D)
    # the last chunk's end state (the padding after the last token changes nothing), copied: an output never aliases
    final = saved[1][:, -1].clone(memory_format=torch.contiguous_format)
    _, alpha = _first_document_decay(k, seq_idx)
    return y, final, alpha, [t.contiguous().view(-1) for t in saved]


def _first_document_decay(k: _Chunks, seq_idx: Tensor) -> tuple[Tensor, Tensor]:
    """``(first [b, T, 1], alpha [b, T, H])``: the tokens of each row's first document, and the product of their
    decays from the row start (a cumsum of their log decays, masked before the sum; 0 elsewhere)."""
    first = (seq_idx == seq_idx[:, :1])[..., None]
    log_decay = k.dt.flatten(1, 2)[:, : k.total] * k.A
    alpha = torch.where(first, log_decay, 0).cumsum(1).masked_fill(~first, -torch.inf).exp()
    return first, alpha


def fake_state(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    y, saved = fake(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    batch, total, heads, head_dim = x.shape
    dtype = scan_dtype(x, dt, A, B, C)
    return y, x.new_empty(batch, heads, head_dim, B.shape[3], dtype=dtype), x.new_empty(batch, total, heads,
                                                                                        dtype=dtype), saved


def backward_state(grad_y, d_final, d_alpha, out, saved, needs_grad, x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size,
                   dt_softplus, dt_min, dt_max):
    k = _Chunks(x, dt, A, B, C, seq_idx, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, pad_continues=True)
    first, alpha = _first_document_decay(k, seq_idx)
    # alpha = exp(cumsum of the first document's log decays): each log decay gets the sum of the later d_alpha alpha
    d_cumulative = d_alpha * alpha
    d_log_decay = torch.where(first, d_cumulative.flip(1).cumsum(1).flip(1), 0)
    return _backward(k, grad_y, saved, x, B, D, dt_bias, dt_softplus, dt_min, dt_max, d_final=d_final,
                     d_log_decay_extra=d_log_decay)


PATH_STATE = Path(forward=forward_state, backward=backward_state, fake=fake_state)
