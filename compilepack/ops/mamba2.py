"""``compilepack::mamba2_chunk_scan_varlen``: the Mamba2 SSD chunk scan, reset at every document start.

Layout follows mamba-ssm (``mamba_chunk_scan_combined``) and transformers' ``mamba2_chunk_scan``, which Bamba,
Mamba2, Zamba2, FalconH1, NemotronH and GraniteMoeHybrid share verbatim:

- ``x``: ``[b, T, H, P]``; ``dt``: ``[b, T, H]``; ``A``: ``[H]`` (negative); ``B``, ``C``: ``[b, T, G, N]``
  with ``H % G == 0`` (head ``h`` reads group ``h // (H // G)``)
- ``seq_idx``: ``int32 [b, T]`` document index of every token, non-decreasing along a row; a document starts
  where it changes, and the first token of a row always starts one
- returns ``y``: ``[b, T, H, P]``

The reference is the stock chunked SSD algorithm with four masks, all from ``seq_idx`` equality (the test
mamba-ssm's kernels use, so both backends agree token for token):

1. inside a chunk, a token reads only earlier tokens of its own document (the segment-sum mask);
2. a chunk's state is written only by tokens of the document its last token belongs to;
3. the state carried from chunk ``k`` to chunk ``c`` survives only if their last tokens share a document
   (the between-chunk decay mask);
4. a token reads the carried-in state only if it belongs to the document of the previous chunk's last token.

The forward also returns the per-chunk states and the intra-chunk decay, so the backward (hand-derived, the
transpose of each einsum in turn) recomputes only cheap pieces. On CUDA, ``backend="mamba_ssm"`` calls mamba-ssm's Triton forward and its own
low-level backward.

A second op, ``compilepack::mamba2_split_conv1d_scan_varlen``, is Bamba's fused training path (in-projection
output -> depthwise causal conv -> scan -> gated RMSNorm -> out-projection) with the same resets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import backends

MAMBA_SSM = "mamba_ssm"
SSD_COMBINED = "mamba_ssm.ops.triton.ssd_combined"  # the module holding the SSD forward/backward functions
EMPTY = (0,)  # shape of the placeholder returned for an absent optional gradient / saved tensor


def mamba2_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    seq_idx: torch.Tensor | None = None,
    *,
    backend: str = backends.REFERENCE,
) -> torch.Tensor:
    """Mamba2 SSD scan over packed documents; the state restarts at every document start.

    Args:
        x: ``[b, T, H, P]`` inputs (heads ``H`` of width ``P``).
        dt: ``[b, T, H]`` raw time steps; processed exactly as transformers' ``mamba2_chunk_scan`` does:
            ``dt + dt_bias``, then softplus if ``dt_softplus``, then clamped to ``dt_limit``.
        A: ``[H]`` negative decay rates (``-exp(A_log)``).
        B: ``[b, T, G, N]`` input projections, ``H % G == 0``.
        C: ``[b, T, G, N]`` output projections.
        chunk_size: Python int, the SSD chunk length (the model config's ``mamba_chunk_size``).
        D: ``[H]`` or ``[H, P]`` skip connection, or None.
        dt_bias: ``[H]`` or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: ``(min, max)`` clamp of the processed ``dt``.
        seq_idx: ``int32 [b, T]`` document index per token, non-decreasing along each row (the HF collator's
            ``seq_idx``). Required: without it the scan would run through document boundaries.
        backend: CUDA library used when the tensors are on CUDA (``"mamba_ssm"`` or ``"reference"``); chosen
            once by ``compilepack.patch``.

    Returns:
        ``y``: ``[b, T, H, P]``. Its dtype is what transformers' ``mamba2_chunk_scan`` returns on the same
        device: float32 from the reference (which computes in float32, or float64 for float64 inputs), and
        ``x.dtype`` from mamba-ssm's kernel.
    """
    _check_scan_args(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx)
    dt_min, dt_max = (float(limit) for limit in dt_limit)
    y, _saved = torch.ops.compilepack.mamba2_chunk_scan_varlen(
        x, dt, A, B, C, seq_idx.to(torch.int32), D, dt_bias, chunk_size, bool(dt_softplus), dt_min, dt_max,
        backend,
    )
    return y


# ----------------------------------------------------------------------------------------------- checks


def _fail(argument: str, expected: str, got) -> None:
    raise ValueError(f"mamba2_chunk_scan_varlen: {argument} must be {expected}, got {got}.")


def _check_scan_args(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx) -> None:
    """Errors a caller can fix, from shapes and dtypes only (static facts, safe to trace)."""
    if seq_idx is None:
        raise ValueError(
            "mamba2_chunk_scan_varlen: seq_idx=None would scan the whole row as one sequence; pass the "
            "collator's seq_idx (int32 [b, T], document index per token)."
        )
    if not isinstance(chunk_size, (int, torch.SymInt)) or chunk_size <= 0:
        _fail("chunk_size", "a positive Python int", repr(chunk_size))
    if x.dim() != 4:
        _fail("x", "[b, T, H, P]", tuple(x.shape))
    batch, total, heads, _ = x.shape
    if dt.shape != (batch, total, heads):
        _fail("dt", f"[b, T, H] = {(batch, total, heads)}", tuple(dt.shape))
    if A.shape != (heads,):
        _fail("A", f"[H] = {(heads,)}", tuple(A.shape))
    if B.dim() != 4 or B.shape[:2] != (batch, total) or heads % B.shape[2] != 0:
        _fail("B", f"[b, T, G, N] with b, T = {(batch, total)} and H = {heads} a multiple of G", tuple(B.shape))
    if C.shape != B.shape:
        _fail("C", f"the shape of B {tuple(B.shape)}", tuple(C.shape))
    if D is not None and D.shape not in ((heads,), (heads, x.shape[3])):
        _fail("D", f"[H] = {(heads,)} or [H, P] = {(heads, x.shape[3])}", tuple(D.shape))
    if dt_bias is not None and dt_bias.shape != (heads,):
        _fail("dt_bias", f"[H] = {(heads,)}", tuple(dt_bias.shape))
    if seq_idx.shape != (batch, total):
        _fail("seq_idx", f"[b, T] = {(batch, total)}", tuple(seq_idx.shape))
    if seq_idx.dtype not in (torch.int32, torch.int64):
        _fail("seq_idx", "an int32 (or int64) tensor of document indices", seq_idx.dtype)
    for name, tensor in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        if not tensor.is_floating_point():
            _fail(name, "a floating-point tensor", tensor.dtype)


# ----------------------------------------------------------------------------------------------- custom ops


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The reference computes in float32 like transformers (float64 stays float64, for exactness tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def _scan_output_dtype(x: torch.Tensor, backend: str) -> torch.dtype:
    return x.dtype if backends.use_kernel(x, backend) else _compute_dtype(x)


def _num_chunks(total, chunk_size: int):
    return (total + chunk_size - 1) // chunk_size


@torch.library.custom_op("compilepack::mamba2_chunk_scan_varlen", mutates_args=())
def _scan_fwd_op(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    seq_idx: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    chunk_size: int,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    backend: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Returns ``(y, saved)``: ``saved`` feeds the backward (the reference's chunk states, end states and
    intra-chunk decay; nothing on the kernel path, whose backward rebuilds what it needs itself)."""
    if backends.use_kernel(x, backend):
        return _kernel_scan_forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max), []
    return _reference_scan_forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)


@_scan_fwd_op.register_fake
def _(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, backend):
    batch, total, heads, head_dim = x.shape
    y = x.new_empty(batch, total, heads, head_dim, dtype=_scan_output_dtype(x, backend))
    if backends.use_kernel(x, backend):
        return y, []
    return y, _fake_saved_states(x, batch, total, heads, head_dim, B.shape[3], chunk_size)


def _fake_saved_states(like, batch, total, heads, head_dim, state_size, chunk_size) -> list[torch.Tensor]:
    """Shapes of ``(chunk_states, end_states, decay)`` saved by :func:`_reference_scan_forward`."""
    nchunks = _num_chunks(total, chunk_size)
    states = batch * nchunks * heads * head_dim * state_size
    decay = batch * nchunks * heads * chunk_size * chunk_size
    dtype = _compute_dtype(like)
    return [like.new_empty(numel, dtype=dtype) for numel in (states, states, decay)]


@torch.library.custom_op("compilepack::mamba2_chunk_scan_varlen_backward", mutates_args=())
def _scan_bwd_op(
    grad_y: torch.Tensor,
    y: torch.Tensor,
    saved: list[torch.Tensor],
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    seq_idx: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    chunk_size: int,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dx, ddt, dA, dB, dC, dD, ddt_bias)`` in the inputs' dtypes; ``dD`` / ``ddt_bias`` are empty
    tensors when ``D`` / ``dt_bias`` is None."""
    args = (x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    if backends.use_kernel(x, backend):
        grads = _kernel_scan_backward(grad_y, y, *args)
    else:
        grads = _reference_scan_backward(grad_y, saved, *args)
    return _grads_in_input_dtypes(grads, (x, dt, A, B, C, D, dt_bias))


@_scan_bwd_op.register_fake
def _(grad_y, y, saved, x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, backend):
    return tuple(
        torch.empty_like(t) if t is not None else x.new_empty(EMPTY) for t in (x, dt, A, B, C, D, dt_bias)
    )


def _grads_in_input_dtypes(grads, inputs) -> tuple[torch.Tensor, ...]:
    """Cast each gradient to its input's dtype (contiguous), an empty placeholder for an absent input."""
    out = []
    for grad, tensor in zip(grads, inputs):
        if tensor is None:
            out.append(inputs[0].new_empty(EMPTY))
        else:
            out.append(grad.to(tensor.dtype).reshape(tensor.shape).contiguous())
    return tuple(out)


def _scan_setup_context(ctx, inputs, output):
    x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, backend = inputs
    y, saved = output
    ctx.save_for_backward(y, x, dt, A, B, C, seq_idx, D, dt_bias, *saved)
    ctx.args = (chunk_size, dt_softplus, dt_min, dt_max, backend)


def _scan_backward(ctx, grad_y, _grad_saved):
    y, x, dt, A, B, C, seq_idx, D, dt_bias, *saved = ctx.saved_tensors
    dx, ddt, dA, dB, dC, dD, ddt_bias = torch.ops.compilepack.mamba2_chunk_scan_varlen_backward(
        grad_y, y, saved, x, dt, A, B, C, seq_idx, D, dt_bias, *ctx.args
    )
    return (
        dx, ddt, dA, dB, dC, None,
        dD if D is not None else None,
        ddt_bias if dt_bias is not None else None,
        None, None, None, None, None,
    )


_scan_fwd_op.register_autograd(_scan_backward, setup_context=_scan_setup_context)


# ----------------------------------------------------------------------------------------------- reference


def _process_dt(dt, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float):
    """transformers' dt processing, in dt's own dtype as there: ``(biased, activated, processed)`` (the first
    two feed the backward of the softplus and the clamp)."""
    biased = dt if dt_bias is None else dt + dt_bias.to(dt.dtype)
    activated = F.softplus(biased) if dt_softplus else biased
    return biased, activated, torch.clamp(activated, min=dt_min, max=dt_max)


def _pad_time(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) to a whole number of chunks: padded tokens have dt = 0 (no decay, no input)."""
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)


def _tril(size: int, device, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(diagonal)


def _segment_sum(a: torch.Tensor, strict_lower: torch.Tensor) -> torch.Tensor:
    """``out[..., l, s] = sum_{s < k <= l} a[..., k]`` for ``s <= l`` (garbage above the diagonal, masked by the
    caller); ``strict_lower`` is ``_tril(size, -1)``. Summed directly, as transformers' ``segment_sum`` does,
    rather than as a difference of cumsums, which loses precision over long chunks with strong decay."""
    return torch.where(strict_lower, a[..., :, None], 0).cumsum(dim=-2)


def _segment_sum_backward(grad: torch.Tensor, strict_lower: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`_segment_sum` for a ``grad`` that is zero above the diagonal:
    ``da[k] = sum_{l >= k} sum_{s < k} grad[l, s] = sum_{l > k-1} cumsum_s(grad)[l, k-1]``."""
    below = torch.where(strict_lower, grad.cumsum(dim=-1), 0).sum(dim=-2)
    return F.pad(below[..., :-1], (1, 0))


class _Chunked:
    """One scan's inputs cut into chunks, with the document masks; shared by the forward and the backward.

    Index names (as in the einsums): b batch row, c chunk, l and s positions in a chunk, g group, j head in
    its group (head h = g * J + j), p head dim, n state dim.
    ``x``, ``x_dt``: ``[b, c, l, g, j, p]``; ``dt``: ``[b, c, l, H]``; ``B``, ``C``: ``[b, c, l, g, n]``;
    ``log_decay``, ``A_cumsum``: ``[b, c, H, l]``; ``other_doc``: ``[b, c, l, s]`` (True where token l must not
    read token s); ``write``, ``read``: ``[b, c, l]``; ``no_carry``: ``[b, c, k]`` (True where the state at the
    end of chunk k does not reach the end of chunk c).
    """

    def __init__(self, x, dt, A, B, C, seq_idx, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
        dtype = _compute_dtype(x)
        batch, total, heads, head_dim = x.shape
        groups, state_size = B.shape[2], B.shape[3]
        self.total, self.heads, self.groups = total, heads, groups
        self.nchunks = _num_chunks(total, chunk_size)
        pad = self.nchunks * chunk_size - total
        chunks = (batch, self.nchunks, chunk_size)

        self.dt_biased, self.dt_activated, dt_processed = _process_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
        self.dt = _pad_time(dt_processed.to(dtype), pad).view(*chunks, heads)
        self.x = _pad_time(x.to(dtype), pad).view(*chunks, groups, heads // groups, head_dim)
        self.x_dt = self.x * self.dt.view(*chunks, groups, heads // groups, 1)
        self.B = _pad_time(B.to(dtype), pad).view(*chunks, groups, state_size)
        self.C = _pad_time(C.to(dtype), pad).view(*chunks, groups, state_size)
        self.A = A.to(dtype)
        self.log_decay = (self.dt * self.A).transpose(2, 3)
        self.A_cumsum = self.log_decay.cumsum(dim=-1)

        # Padded tokens join the row's last document; they carry nothing (x = dt = 0).
        seq = torch.cat([seq_idx, seq_idx[:, -1:].expand(batch, pad)], dim=1).view(chunks)
        last = seq[:, :, -1]
        previous_last = torch.cat([last[:, :1], last[:, :-1]], dim=1)  # chunk 0 has no carried-in state
        self.strict_lower = _tril(chunk_size, x.device, -1)
        self.other_doc = (seq[:, :, :, None] != seq[:, :, None, :]) | ~_tril(chunk_size, x.device)
        self.write = seq == last[:, :, None]
        self.read = seq == previous_last[:, :, None]
        self.chunks_strict_lower = _tril(self.nchunks, x.device, -1)
        self.no_carry = (last[:, :, None] != last[:, None, :]) | ~_tril(self.nchunks, x.device)

    def heads_view(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, c, H, ...]`` -> ``[b, c, g, j, ...]``."""
        return t.view(t.shape[0], t.shape[1], self.groups, self.heads // self.groups, *t.shape[3:])

    def intra_chunk_weights(self, decay: torch.Tensor | None = None):
        """``(CB, decay, W)``: ``CB [b, c, g, l, s] = C_l . B_s``; ``decay [b, c, H, l, s]`` from token s to
        token l inside one document (0 across documents and above the diagonal; computed unless given);
        ``W [b, c, g, j, l, s] = CB * decay``."""
        CB = torch.einsum("bclgn,bcsgn->bcgls", self.C, self.B)
        if decay is None:
            decay = _segment_sum(self.log_decay, self.strict_lower).exp_().masked_fill_(self.other_doc[:, :, None], 0)
        return CB, decay, self.heads_view(decay) * CB[:, :, :, None]

    def write_decay(self) -> torch.Tensor:
        """``[b, c, H, l]``: decay from token l to the end of its chunk, 0 unless l is in the last document."""
        return torch.exp(self.A_cumsum[..., -1:] - self.A_cumsum) * self.write[:, :, None]

    def read_decay(self) -> torch.Tensor:
        """``[b, c, H, l]``: decay from the chunk start to token l, 0 unless l continues the carried document."""
        return torch.exp(self.A_cumsum) * self.read[:, :, None]

    def carry_decay(self) -> torch.Tensor:
        """``[b, H, c, k]``: decay from the end of chunk k to the end of chunk c (k <= c), 0 across documents."""
        chunk_log_decay = self.A_cumsum[..., -1].transpose(1, 2)  # [b, H, c]
        return _segment_sum(chunk_log_decay, self.chunks_strict_lower).exp_().masked_fill_(self.no_carry[:, None], 0)


def _reference_scan_forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    """Masked SSD: ``(y [b, T, H, P], [chunk_states, end_states, decay])``; states ``[b, c, H, P, N]`` are what
    each chunk writes and the state at each chunk's end, ``decay`` the intra-chunk decay (saved for the backward,
    which would otherwise redo its segment sum and exp)."""
    k = _Chunked(x, dt, A, B, C, seq_idx, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    _CB, decay, W = k.intra_chunk_weights()
    y = torch.einsum("bcgjls,bcsgjp->bclgjp", W, k.x_dt)

    x_written = k.x_dt * _token_major(k.heads_view(k.write_decay()))[..., None]
    chunk_states = torch.einsum("bclgn,bclgjp->bcgjpn", k.B, x_written).flatten(2, 3)
    end_states = torch.einsum("bhck,bkhpn->bchpn", k.carry_decay(), chunk_states)
    start_states = _shift_chunks(end_states)
    y_carried = torch.einsum("bclgn,bcgjpn->bclgjp", k.C, k.heads_view(start_states))
    y += y_carried * _token_major(k.heads_view(k.read_decay()))[..., None]

    y = y.reshape(x.shape[0], -1, *x.shape[2:])[:, : k.total]
    if D is not None:
        y = y + _skip(x.to(y.dtype), D.to(y.dtype))
    return y.contiguous(), _flat_saved(chunk_states, end_states, decay)


def _flat_saved(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Saved tensors as flat 1-D buffers. Shaped ``[b, chunks, ...]`` they would expose the chunk count as a
    dimension of its own, which the compiler specialises when it is 1 (one recompile for any batch of at most
    one chunk); a flat length ``b * chunks * H * ...`` never equals 1."""
    return [t.contiguous().view(-1) for t in tensors]


def _unflat_saved(saved, batch: int, nchunks: int, heads: int, head_dim: int, state_size: int, chunk_size: int):
    chunk_states, end_states, decay = saved
    states = (batch, nchunks, heads, head_dim, state_size)
    return chunk_states.view(states), end_states.view(states), decay.view(batch, nchunks, heads, chunk_size, chunk_size)


def _shift_chunks(end_states: torch.Tensor) -> torch.Tensor:
    """State at each chunk's start: the previous chunk's end state, zero for chunk 0 (no initial state)."""
    return torch.cat([torch.zeros_like(end_states[:, :1]), end_states[:, :-1]], dim=1)


def _skip(x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``D * x`` for ``D`` of shape ``[H]`` or ``[H, P]``."""
    return x * (D[:, None] if D.dim() == 1 else D)


def _reference_scan_backward(grad_y, saved, x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min,
                             dt_max):
    """Hand-derived gradients of :func:`_reference_scan_forward`, each einsum's transpose in turn (the saved
    states spare recomputing the state passing)."""
    k = _Chunked(x, dt, A, B, C, seq_idx, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    chunk_states, end_states, decay = _unflat_saved(saved, x.shape[0], k.nchunks, x.shape[2], x.shape[3],
                                                    B.shape[3], chunk_size)
    pad = k.nchunks * chunk_size - k.total
    dy = _pad_time(grad_y.to(k.x.dtype), pad).view_as(k.x)

    # y += read_decay * (C . start_state)
    read = _token_major(k.heads_view(k.read_decay()))
    dy_start = torch.einsum("bclgjp,bcgjpn->bclgjn", dy, k.heads_view(_shift_chunks(end_states)))
    d_read = torch.einsum("bclgjn,bclgn->bclgj", dy_start, k.C)
    dC = torch.einsum("bclgjn,bclgj->bclgn", dy_start, read)
    d_start = torch.einsum("bclgjp,bclgn->bcgjpn", dy * read[..., None], k.C).flatten(2, 3)
    d_A_cumsum = _heads_first(d_read * read)

    # end_state[c] = sum_k carry_decay[c, k] * chunk_state[k]
    d_end = torch.cat([d_start[:, 1:], torch.zeros_like(d_start[:, :1])], dim=1)
    carry = k.carry_decay()
    d_chunk_states = k.heads_view(torch.einsum("bhck,bchpn->bkhpn", carry, d_end))
    d_carry = torch.einsum("bchpn,bkhpn->bhck", d_end, chunk_states).mul_(carry)
    d_A_cumsum[..., -1] += _segment_sum_backward(d_carry, k.chunks_strict_lower).transpose(1, 2)

    # chunk_state = sum_l B_l * write_decay_l * x_dt_l
    write = _token_major(k.heads_view(k.write_decay()))
    B_d_states = torch.einsum("bclgn,bcgjpn->bclgjp", k.B, d_chunk_states)
    d_x_dt = B_d_states * write[..., None]
    dB = torch.einsum("bclgjp,bcgjpn->bclgn", k.x_dt * write[..., None], d_chunk_states)
    d_write = _heads_first((B_d_states * k.x_dt).sum(-1) * write)
    d_A_cumsum -= d_write
    d_A_cumsum[..., -1] += d_write.sum(-1)

    # y = sum_s (CB * decay)[l, s] * x_dt_s inside the chunk
    CB, decay, W = k.intra_chunk_weights(decay)
    d_x_dt += torch.einsum("bcgjls,bclgjp->bcsgjp", W, dy)
    d_decay = torch.einsum("bclgjp,bcsgjp->bcgjls", dy, k.x_dt).mul_(k.heads_view(decay))  # dW * decay
    dCB = d_decay.sum(3)
    dC += torch.einsum("bcgls,bcsgn->bclgn", dCB, k.B)
    dB += torch.einsum("bcgls,bclgn->bcsgn", dCB, k.C)
    d_log_decay = _segment_sum_backward(d_decay.mul_(CB[:, :, :, None]).flatten(2, 3), k.strict_lower)

    # A_cumsum = cumsum(dt * A)
    d_log_decay += d_A_cumsum.flip(-1).cumsum(-1).flip(-1)
    d_log_decay = d_log_decay.transpose(2, 3)  # [b, c, l, H]
    dA = (d_log_decay * k.dt).sum((0, 1, 2))
    d_dt = d_log_decay * k.A + (d_x_dt * k.x).sum(-1).flatten(3)
    dx = d_x_dt * k.dt.view(*k.dt.shape[:3], k.groups, -1, 1)

    batch, total = x.shape[:2]
    dx = dx.reshape(batch, -1, *x.shape[2:])[:, :total]
    d_dt = _dt_processing_backward(d_dt.reshape(batch, -1, x.shape[2])[:, :total], k, dt_softplus, dt_min, dt_max)
    dB, dC = (g.reshape(batch, -1, *B.shape[2:])[:, :total] for g in (dB, dC))
    dD = None
    if D is not None:
        grad = grad_y.to(dx.dtype)
        dx = dx + _skip(grad, D.to(dx.dtype))
        dD = (grad * x.to(dx.dtype)).sum((0, 1))
        dD = dD.sum(-1) if D.dim() == 1 else dD
    d_dt_bias = d_dt.sum((0, 1)) if dt_bias is not None else None
    return dx, d_dt, dA, dB, dC, dD, d_dt_bias


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """``[b, c, g, j, l]`` -> ``[b, c, l, g, j]``."""
    return t.permute(0, 1, 4, 2, 3)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[b, c, l, g, j]`` -> ``[b, c, H, l]`` (contiguous: it is accumulated into)."""
    return t.flatten(3).transpose(2, 3).contiguous()


def _dt_processing_backward(d_dt, k: _Chunked, dt_softplus, dt_min, dt_max):
    """Through the clamp (gradient passes where min <= dt <= max, as torch.clamp) and the softplus (identity
    above torch's threshold of 20)."""
    activated = k.dt_activated.to(d_dt.dtype)
    d_dt = d_dt * ((activated >= dt_min) & (activated <= dt_max))
    if dt_softplus:
        biased = k.dt_biased.to(d_dt.dtype)
        d_dt = d_dt * torch.where(biased > 20.0, 1.0, torch.sigmoid(biased))
    return d_dt


# ----------------------------------------------------------------------------------------------- mamba-ssm
# Read in state-spaces/mamba at e9594ce (mamba-ssm 2.3.2.post1), mamba_ssm/ops/triton/ssd_combined.py:
# - mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, ...) is the
#   public forward; _mamba_chunk_scan_combined_bwd(dout, x, dt, A, B, C, out, chunk_size, D=, z=, dt_bias=,
#   initial_states=, dfinal_states=, seq_idx=, dt_softplus=, dt_limit=) is what its autograd Function calls and
#   returns (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states) with dA / ddt_bias in float32.
# - The Triton kernels take strides, but B, C, D and dout must have stride(-1) == 1 and x stride(-1) or
#   stride(1) == 1; seq_idx is read as an int32 [b, T] tensor (equality of neighbours marks a reset); the
#   output is allocated as x.dtype. We pass every tensor contiguous, seq_idx int32, ints and floats as Python.


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _kernel_scan_forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    ssd = backends.load(SSD_COMBINED)
    return ssd.mamba_chunk_scan_combined(
        x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(), chunk_size,
        D=_contiguous(D), z=None, dt_bias=_contiguous(dt_bias), seq_idx=seq_idx.to(torch.int32).contiguous(),
        dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
    )


def _kernel_scan_backward(grad_y, y, x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    ssd = backends.load(SSD_COMBINED)
    dx, ddt, dA, dB, dC, dD, _dz, ddt_bias, _dinitial = ssd._mamba_chunk_scan_combined_bwd(
        grad_y.to(y.dtype).contiguous(), x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(),
        C.contiguous(), y, chunk_size, D=_contiguous(D), z=None, dt_bias=_contiguous(dt_bias),
        initial_states=None, dfinal_states=None, seq_idx=seq_idx.to(torch.int32).contiguous(),
        dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
    )
    return dx, ddt, dA, dB, dC, dD, ddt_bias


# ======================================================================================= fused Bamba path


def mamba2_split_conv1d_scan_varlen(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    seq_idx: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    activation: str | None = "silu",
    rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float | None = 1e-6,
    outproj_weight: torch.Tensor | None = None,
    outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    *,
    backend: str = backends.REFERENCE,
) -> torch.Tensor:
    """Bamba's fused Mamba2 mixer after the in-projection, reset at every document start.

    Arguments as mamba-ssm's ``mamba_split_conv1d_scan_combined`` (without ``initial_states`` /
    ``return_final_states``, which a packed training step never uses):

    Args:
        zxbcdt: ``[b, T, dim + conv_dim + H]``, the in-projection output: gate ``z`` (``dim = H * P``), the conv
            input ``xBC`` (``conv_dim = dim + 2 * ngroups * N``) and the raw ``dt``.
        conv1d_weight: ``[conv_dim, width]`` depthwise causal conv weight (``conv1d.weight.squeeze(1)``).
        conv1d_bias: ``[conv_dim]`` or None.
        dt_bias: ``[H]``; ``dt`` is always softplus-ed, as in the library.
        A: ``[H]`` negative decay rates.
        D: ``[H]`` (then ``headdim`` is required) or ``[H, P]``.
        chunk_size: Python int.
        seq_idx: ``int32 [b, T]`` document index per token; required. The conv and the scan reset at every
            document start.
        dt_limit: clamp of the processed ``dt``.
        activation: ``"silu"`` / ``"swish"`` after the conv, or None.
        rmsnorm_weight: ``[dim]`` gated RMSNorm weight (groups of ``dim // ngroups``), or None for plain
            ``y * silu(z)`` gating.
        rmsnorm_eps: RMSNorm epsilon (None only without ``rmsnorm_weight``, as FalconH1 passes it).
        outproj_weight: ``[out, dim]`` out-projection weight, or None.
        outproj_bias: ``[out]`` or None.
        headdim: ``P`` when ``D`` is ``[H]``.
        ngroups: ``G``, the number of B/C groups (also the RMSNorm groups).
        norm_before_gate: ``RMSNorm(y) * silu(z)`` if True, ``RMSNorm(y * silu(z))`` if False (Bamba).
        backend: ``"mamba_ssm"`` (the library's fused forward and backward on CUDA) or ``"reference"``.

    Returns:
        ``[b, T, out]`` (``[b, T, dim]`` without out-projection) in ``zxbcdt.dtype``.
    """
    _check_split_args(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, seq_idx, activation,
                      rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups)
    headdim = D.shape[1] if D.dim() == 2 else int(headdim)
    dt_min, dt_max = (float(limit) for limit in dt_limit)
    out, _saved = torch.ops.compilepack.mamba2_split_conv1d_scan_varlen(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx.to(torch.int32), rmsnorm_weight,
        outproj_weight, outproj_bias, chunk_size, dt_min, dt_max, activation or "none",
        1e-6 if rmsnorm_eps is None else float(rmsnorm_eps),  # FalconH1 passes None along with no norm weight
        headdim, int(ngroups), bool(norm_before_gate), backend,
    )
    return out


def _split_fail(argument: str, expected: str, got) -> None:
    raise ValueError(f"mamba2_split_conv1d_scan_varlen: {argument} must be {expected}, got {got}.")


def _check_split_args(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, seq_idx, activation,
                      rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups) -> None:
    """Shape/dtype errors a caller can fix (static facts only, safe to trace)."""
    if seq_idx is None:
        raise ValueError(
            "mamba2_split_conv1d_scan_varlen: seq_idx=None would scan the whole row as one sequence; pass the "
            "collator's seq_idx (int32 [b, T], document index per token)."
        )
    if not isinstance(chunk_size, (int, torch.SymInt)) or chunk_size <= 0:
        _split_fail("chunk_size", "a positive Python int", repr(chunk_size))
    if activation not in (None, "silu", "swish"):
        _split_fail("activation", "'silu', 'swish' or None (mamba-ssm's choices)", repr(activation))
    if zxbcdt.dim() != 3:
        _split_fail("zxbcdt", "[b, T, dim + conv_dim + H]", tuple(zxbcdt.shape))
    if A.dim() != 1 or dt_bias.shape != A.shape:
        _split_fail("A and dt_bias", "[H] each", (tuple(A.shape), tuple(dt_bias.shape)))
    heads = A.shape[0]
    if D.dim() == 1 and headdim is None:
        _split_fail("headdim", "given when D is [H]", None)
    head_dim = D.shape[1] if D.dim() == 2 else headdim
    if D.shape not in ((heads,), (heads, head_dim)):
        _split_fail("D", f"[H] or [H, P] with H = {heads}", tuple(D.shape))
    if not isinstance(ngroups, int) or ngroups <= 0 or heads % ngroups != 0:
        _split_fail("ngroups", f"a positive int dividing H = {heads}", repr(ngroups))
    dim = heads * head_dim
    if conv1d_weight.dim() != 2 or (conv1d_weight.shape[0] - dim) <= 0 or (conv1d_weight.shape[0] - dim) % (
        2 * ngroups
    ) != 0:
        _split_fail("conv1d_weight", f"[dim + 2 * ngroups * N, width] with dim = {dim}, ngroups = {ngroups}",
                    tuple(conv1d_weight.shape))
    conv_dim = conv1d_weight.shape[0]
    if conv1d_bias is not None and conv1d_bias.shape != (conv_dim,):
        _split_fail("conv1d_bias", f"[conv_dim] = {(conv_dim,)}", tuple(conv1d_bias.shape))
    if zxbcdt.shape[2] != dim + conv_dim + heads:
        _split_fail("zxbcdt", f"[b, T, dim + conv_dim + H] = [b, T, {dim + conv_dim + heads}] (no extra MLP "
                    "channels)", tuple(zxbcdt.shape))
    if seq_idx.shape != zxbcdt.shape[:2]:
        _split_fail("seq_idx", f"[b, T] = {tuple(zxbcdt.shape[:2])}", tuple(seq_idx.shape))
    if seq_idx.dtype not in (torch.int32, torch.int64):
        _split_fail("seq_idx", "an int32 (or int64) tensor of document indices", seq_idx.dtype)
    if rmsnorm_weight is not None and rmsnorm_weight.shape != (dim,):
        _split_fail("rmsnorm_weight", f"[dim] = {(dim,)}", tuple(rmsnorm_weight.shape))
    if rmsnorm_weight is not None and rmsnorm_eps is None:
        _split_fail("rmsnorm_eps", "a float when rmsnorm_weight is given", None)
    if outproj_weight is not None and (outproj_weight.dim() != 2 or outproj_weight.shape[1] != dim):
        _split_fail("outproj_weight", f"[out, dim] with dim = {dim}", tuple(outproj_weight.shape))
    if outproj_bias is not None and (outproj_weight is None or outproj_bias.shape != outproj_weight.shape[:1]):
        _split_fail("outproj_bias", "[out] next to an outproj_weight", tuple(outproj_bias.shape))


class _SplitDims:
    """Channel sizes of the fused layout, from the op's arguments."""

    def __init__(self, zxbcdt, conv1d_weight, A, headdim, ngroups):
        self.heads, self.headdim, self.groups = A.shape[0], headdim, ngroups
        self.dim = self.heads * headdim
        self.conv_dim = conv1d_weight.shape[0]
        self.state_size = (self.conv_dim - self.dim) // ngroups // 2
        self.batch, self.total = zxbcdt.shape[:2]

    def split_input(self, zxbcdt):
        """``z [b, T, dim]``, ``xBC [b, T, conv_dim]``, ``dt [b, T, H]``."""
        return torch.split(zxbcdt, [self.dim, self.conv_dim, self.heads], dim=-1)

    def split_conv_output(self, xBC):
        """``x [b, T, H, P]``, ``B``, ``C`` ``[b, T, G, N]``."""
        x, B, C = torch.split(xBC, [self.dim, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        shape = (self.batch, self.total)
        return (x.reshape(*shape, self.heads, self.headdim), B.reshape(*shape, self.groups, self.state_size),
                C.reshape(*shape, self.groups, self.state_size))


@torch.library.custom_op("compilepack::mamba2_split_conv1d_scan_varlen", mutates_args=())
def _split_fwd_op(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    seq_idx: torch.Tensor,
    rmsnorm_weight: torch.Tensor | None,
    outproj_weight: torch.Tensor | None,
    outproj_bias: torch.Tensor | None,
    chunk_size: int,
    dt_min: float,
    dt_max: float,
    activation: str,
    rmsnorm_eps: float,
    headdim: int,
    ngroups: int,
    norm_before_gate: bool,
    backend: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Returns ``(out, saved)``. Saved for the backward: on the kernel path what mamba-ssm's autograd Function
    saves beyond the inputs (``out_x``, ``rstd``); on the reference path the scan output, the conv output
    before its activation and what the scan saves (chunk states, end states, intra-chunk decay)."""
    args = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, rmsnorm_weight, outproj_weight,
            outproj_bias, chunk_size, dt_min, dt_max, activation, rmsnorm_eps, headdim, ngroups, norm_before_gate)
    if backends.use_kernel(zxbcdt, backend):
        return _kernel_split_forward(*args)
    return _reference_split_forward(*args)


@_split_fwd_op.register_fake
def _(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, rmsnorm_weight, outproj_weight, outproj_bias,
      chunk_size, dt_min, dt_max, activation, rmsnorm_eps, headdim, ngroups, norm_before_gate, backend):
    dims = _SplitDims(zxbcdt, conv1d_weight, A, headdim, ngroups)
    width = outproj_weight.shape[0] if outproj_weight is not None else dims.dim
    out = zxbcdt.new_empty(dims.batch, dims.total, width)
    scan_shape = (dims.batch, dims.total, dims.heads, headdim)
    if backends.use_kernel(zxbcdt, backend):
        rstd_shape = (ngroups * dims.batch * dims.total,) if rmsnorm_weight is not None else EMPTY
        return out, [zxbcdt.new_empty(scan_shape), zxbcdt.new_empty(rstd_shape, dtype=torch.float32)]
    y = zxbcdt.new_empty(scan_shape, dtype=_compute_dtype(zxbcdt))
    pre = zxbcdt.new_empty(dims.batch, dims.total, dims.conv_dim, dtype=conv1d_weight.dtype)
    return out, [y, pre, *_fake_saved_states(zxbcdt, dims.batch, dims.total, dims.heads, headdim,
                                             dims.state_size, chunk_size)]


@torch.library.custom_op("compilepack::mamba2_split_conv1d_scan_varlen_backward", mutates_args=())
def _split_bwd_op(
    grad_out: torch.Tensor,
    saved: list[torch.Tensor],
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    seq_idx: torch.Tensor,
    rmsnorm_weight: torch.Tensor | None,
    outproj_weight: torch.Tensor | None,
    outproj_bias: torch.Tensor | None,
    chunk_size: int,
    dt_min: float,
    dt_max: float,
    activation: str,
    rmsnorm_eps: float,
    headdim: int,
    ngroups: int,
    norm_before_gate: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """Gradients of ``(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, outproj_weight,
    outproj_bias)``, each in its input's dtype; empty placeholders for absent inputs."""
    inputs = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, rmsnorm_weight, outproj_weight,
              outproj_bias)
    statics = (chunk_size, dt_min, dt_max, activation, rmsnorm_eps, headdim, ngroups, norm_before_gate)
    if backends.use_kernel(zxbcdt, backend):
        grads = _kernel_split_backward(grad_out, *saved, *inputs, *statics)
    else:
        grads = _reference_split_backward(grad_out, saved, *inputs, *statics)
    differentiable = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, outproj_weight,
                      outproj_bias)
    return _grads_in_input_dtypes(grads, differentiable)


@_split_bwd_op.register_fake
def _(grad_out, saved, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, rmsnorm_weight, outproj_weight,
      outproj_bias, *statics):
    return tuple(
        torch.empty_like(t) if t is not None else zxbcdt.new_empty(EMPTY)
        for t in (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, outproj_weight, outproj_bias)
    )


def _split_setup_context(ctx, inputs, output):
    _out, saved = output
    ctx.save_for_backward(*inputs[:10], *saved)
    ctx.statics = inputs[10:]


def _split_backward(ctx, grad_out, _grad_saved):
    inputs, saved = ctx.saved_tensors[:10], ctx.saved_tensors[10:]
    grads = torch.ops.compilepack.mamba2_split_conv1d_scan_varlen_backward(grad_out, list(saved), *inputs,
                                                                            *ctx.statics)
    d_zxbcdt, d_conv_w, d_conv_b, d_dt_bias, dA, dD, d_rms_w, d_out_w, d_out_b = grads
    present = lambda grad, tensor: grad if tensor is not None else None  # noqa: E731
    return (
        d_zxbcdt, d_conv_w, present(d_conv_b, inputs[2]), d_dt_bias, dA, dD, None,
        present(d_rms_w, inputs[7]), present(d_out_w, inputs[8]), present(d_out_b, inputs[9]),
        *(None,) * 9,
    )


_split_fwd_op.register_autograd(_split_backward, setup_context=_split_setup_context)


# ----------------------------------------------------------------------------------------------- reference


def _silu_grad(u: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(u)
    return sig * (1 + u * (1 - sig))


def _conv_taps_keep(seq_idx: torch.Tensor, width: int) -> list[torch.Tensor]:
    """``keep[s - 1] [b, T - s, 1]`` for taps ``s = 1 .. width - 1``: True where token ``t >= s`` and the token
    ``s`` back belong to the same document."""
    return [(seq_idx[:, shift:] == seq_idx[:, :-shift])[..., None] for shift in range(1, width)]


def _conv_forward(xBC, weight, bias, keep):
    """Depthwise causal conv as shifted multiply-adds, each tap zeroed where it would reach into the previous
    document (pre-activation, in the weight's dtype as transformers' ``causal_conv1d_fn``)."""
    x = xBC.to(weight.dtype)
    width = weight.shape[1]
    out = x * weight[:, -1] if bias is None else torch.addcmul(bias.to(weight.dtype), x, weight[:, -1])
    for shift in range(1, width):
        out[:, shift:].addcmul_(x[:, :-shift] * keep[shift - 1], weight[:, width - 1 - shift])
    return out


def _conv_backward(d_pre, xBC, weight, keep):
    """``(d_xBC, d_weight, d_bias)`` of :func:`_conv_forward`."""
    x = xBC.to(weight.dtype)
    width = weight.shape[1]
    d_x = d_pre * weight[:, -1]
    d_weight = [(d_pre * x).sum((0, 1))]
    for shift in range(1, width):
        d_kept = d_pre[:, shift:] * keep[shift - 1]
        d_x[:, :-shift].addcmul_(d_kept, weight[:, width - 1 - shift])
        d_weight.append((d_kept * x[:, :-shift]).sum((0, 1)))
    return d_x, torch.stack(d_weight[::-1], dim=1), d_pre.sum((0, 1))


def _activate(pre: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(pre) if activation in ("silu", "swish") else pre


def _gated_norm_forward(y, z, weight, eps, groups, norm_before_gate):
    """``(out, normed, rstd)`` in float32: RMSNorm over ``groups`` channel groups, gated by ``silu(z)`` after
    (``norm_before_gate``) or before the norm (Bamba, as ``BambaRMSNormGated``); plain ``y * silu(z)`` without
    a weight."""
    gate = F.silu(z.to(y.dtype))
    if weight is None:
        return y * gate, None, None
    h = y if norm_before_gate else y * gate
    grouped = h.unflatten(-1, (groups, -1))
    rstd = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    normed = (grouped * rstd).flatten(-2)
    out = weight.to(y.dtype) * normed
    return (out * gate if norm_before_gate else out), normed, rstd


def _gated_norm_backward(d_out, y, z, weight, normed, rstd, groups, norm_before_gate):
    """``(d_y, d_z, d_weight)`` of :func:`_gated_norm_forward`."""
    z = z.to(y.dtype)
    gate = F.silu(z)
    if weight is None:
        return d_out * gate, d_out * y * _silu_grad(z), None
    w = weight.to(y.dtype)
    if norm_before_gate:
        d_weight = (d_out * normed * gate).flatten(0, -2).sum(0)
        d_z = d_out * w * normed * _silu_grad(z)
        d_normed = d_out * w * gate
    else:
        d_weight = (d_out * normed).flatten(0, -2).sum(0)
        d_normed = d_out * w
    n = normed.unflatten(-1, (groups, -1))
    d_n = d_normed.unflatten(-1, (groups, -1))
    d_h = (rstd * (d_n - n * (d_n * n).mean(-1, keepdim=True))).flatten(-2)
    if norm_before_gate:
        return d_h, d_z, d_weight
    return d_h * gate, d_h * y * _silu_grad(z), d_weight


def _reference_split_forward(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, rmsnorm_weight,
                             outproj_weight, outproj_bias, chunk_size, dt_min, dt_max, activation, rmsnorm_eps,
                             headdim, ngroups, norm_before_gate):
    dims = _SplitDims(zxbcdt, conv1d_weight, A, headdim, ngroups)
    z, xBC, dt = dims.split_input(zxbcdt)
    pre = _conv_forward(xBC, conv1d_weight, conv1d_bias, _conv_taps_keep(seq_idx, conv1d_weight.shape[1]))
    x, B, C = dims.split_conv_output(_activate(pre, activation).to(zxbcdt.dtype))
    y, scan_saved = _reference_scan_forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, True, dt_min, dt_max)
    out, _normed, _rstd = _gated_norm_forward(y.flatten(2), z, rmsnorm_weight, rmsnorm_eps, ngroups,
                                              norm_before_gate)
    out = out.to(zxbcdt.dtype)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight.to(out.dtype), _cast(outproj_bias, out.dtype))
    return out, [y, pre, *scan_saved]


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _reference_split_backward(grad_out, saved, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx,
                              rmsnorm_weight, outproj_weight, outproj_bias, chunk_size, dt_min, dt_max, activation,
                              rmsnorm_eps, headdim, ngroups, norm_before_gate):
    """Explicit backward of the composed pieces. The forward saved the scan output ``y``, the conv output before
    its activation and the scan's states; the norm (cheap, elementwise) is recomputed."""
    y, pre, *scan_saved = saved
    dims = _SplitDims(zxbcdt, conv1d_weight, A, headdim, ngroups)
    z, xBC_in, dt = dims.split_input(zxbcdt)
    keep = _conv_taps_keep(seq_idx, conv1d_weight.shape[1])
    x, B, C = dims.split_conv_output(_activate(pre, activation).to(zxbcdt.dtype))
    gated, normed, rstd = _gated_norm_forward(y.flatten(2), z, rmsnorm_weight, rmsnorm_eps, ngroups,
                                              norm_before_gate)

    d_out_w = d_out_b = None
    d_gated = grad_out
    if outproj_weight is not None:
        gated_in = gated.to(zxbcdt.dtype)
        d_gated = grad_out @ outproj_weight.to(grad_out.dtype)
        d_out_w = grad_out.flatten(0, 1).T @ gated_in.flatten(0, 1)
        d_out_b = grad_out.sum((0, 1)) if outproj_bias is not None else None
    d_y, d_z, d_rms_w = _gated_norm_backward(d_gated.to(y.dtype), y.flatten(2), z, rmsnorm_weight, normed, rstd,
                                             ngroups, norm_before_gate)

    dx, ddt, dA, dB, dC, dD, d_dt_bias = _reference_scan_backward(
        d_y.unflatten(-1, (dims.heads, headdim)), scan_saved, x, dt, A, B, C, seq_idx, D, dt_bias,
        chunk_size, True, dt_min, dt_max,
    )
    d_act = torch.cat([dx.flatten(2), dB.flatten(2), dC.flatten(2)], dim=-1).to(pre.dtype)
    d_pre = d_act * _silu_grad(pre) if activation in ("silu", "swish") else d_act
    d_xBC, d_conv_w, d_conv_b = _conv_backward(d_pre, xBC_in, conv1d_weight, keep)
    d_zxbcdt = torch.cat([d_z.to(zxbcdt.dtype), d_xBC.to(zxbcdt.dtype), ddt.to(zxbcdt.dtype)], dim=-1)
    return (d_zxbcdt, d_conv_w, d_conv_b if conv1d_bias is not None else None, d_dt_bias, dA, dD, d_rms_w,
            d_out_w, d_out_b)


# ----------------------------------------------------------------------------------------------- mamba-ssm
# MambaSplitConv1dScanCombinedFn (same file, same commit) has no standalone low-level backward: its
# ``backward(ctx, dout)`` is the glue (conv recompute, _layer_norm_bwd, _mamba_chunk_scan_combined_bwd,
# causal_conv1d_bwd_function). We run its own forward and backward on a stand-in ctx; the tensors its forward
# saves beyond our inputs (out_x, rstd) travel through our forward op's outputs.
# Contract read there: zxbcdt [b, T, d] with conv_dim % 8 == 0 (ensure_stride asserts it); conv1d_weight
# [conv_dim, width]; seq_idx int32 contiguous [b, T]; Python ints for chunk_size / headdim / ngroups;
# activation in (None, "silu", "swish"); the output is zxbcdt.dtype unless autocast is on, so we run it
# with autocast off and hand it the out-projection already in zxbcdt.dtype (what autocast would do).


class _LibraryContext:
    """Stands in for the autograd ctx of mamba-ssm's ``MambaSplitConv1dScanCombinedFn``."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _kernel_split_inputs(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, outproj_weight,
                         outproj_bias):
    dtype = zxbcdt.dtype
    return (zxbcdt.contiguous(), conv1d_weight.contiguous(), _contiguous(conv1d_bias), dt_bias.contiguous(),
            A.contiguous(), D.contiguous(), seq_idx.to(torch.int32).contiguous(),
            _contiguous(_cast(outproj_weight, dtype)), _contiguous(_cast(outproj_bias, dtype)))


def _kernel_split_forward(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, rmsnorm_weight,
                          outproj_weight, outproj_bias, chunk_size, dt_min, dt_max, activation, rmsnorm_eps,
                          headdim, ngroups, norm_before_gate):
    fn = backends.load(SSD_COMBINED).MambaSplitConv1dScanCombinedFn
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, outproj_weight, outproj_bias = (
        _kernel_split_inputs(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, outproj_weight,
                             outproj_bias))
    ctx = _LibraryContext()
    with torch.autocast(zxbcdt.device.type, enabled=False):
        out = fn.forward(
            ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, None, seq_idx, (dt_min, dt_max),
            False, None if activation == "none" else activation, _contiguous(rmsnorm_weight), rmsnorm_eps,
            outproj_weight, outproj_bias, headdim, ngroups, norm_before_gate,
        )
    out_x, rstd = ctx.saved_tensors[3], ctx.saved_tensors[10]
    rstd = rstd if rstd is not None else zxbcdt.new_empty(EMPTY, dtype=torch.float32)
    return out, [out_x, rstd]


def _kernel_split_backward(grad_out, out_x, rstd, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx,
                           rmsnorm_weight, outproj_weight, outproj_bias, chunk_size, dt_min, dt_max, activation,
                           rmsnorm_eps, headdim, ngroups, norm_before_gate):
    fn = backends.load(SSD_COMBINED).MambaSplitConv1dScanCombinedFn
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, outproj_weight, outproj_bias = (
        _kernel_split_inputs(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, seq_idx, outproj_weight,
                             outproj_bias))
    ctx = _LibraryContext()
    # the saved tensors and attributes exactly as the library's forward sets them
    ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, None, seq_idx,
                          _contiguous(rmsnorm_weight), rstd if rmsnorm_weight is not None else None,
                          outproj_weight, outproj_bias)
    ctx.dt_limit, ctx.return_final_states = (dt_min, dt_max), False
    ctx.activation = None if activation == "none" else activation
    ctx.rmsnorm_eps, ctx.norm_before_gate, ctx.chunk_size = rmsnorm_eps, norm_before_gate, chunk_size
    ctx.headdim, ctx.ngroups, ctx.state_dtype = headdim, ngroups, None
    ctx.outproj_weight_dtype = outproj_weight.dtype if outproj_weight is not None else None
    ctx._fwd_used_autocast, ctx._dtype = False, torch.get_autocast_dtype(zxbcdt.device.type)  # custom_fwd's
    grads = fn.backward(ctx, grad_out.to(zxbcdt.dtype).contiguous())
    d_zxbcdt, d_conv_w, d_conv_b, d_dt_bias, dA, dD = grads[:6]
    d_rms_w, _, d_out_w, d_out_b = grads[12:16]
    return d_zxbcdt, d_conv_w, d_conv_b, d_dt_bias, dA, dD, d_rms_w, d_out_w, d_out_b
