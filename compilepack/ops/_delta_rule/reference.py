"""A delta rule's reference paths, without and with a state, shared by the gated delta rule and Kimi delta attention
(each gives its chunk builder, its run over the chunks and its backward: :func:`reference_paths`).

Without a state, the forward saves the state at every chunk start and every chunk's ``A^-1``, flat, and the backward
rebuilds the chunks with the saved inverses.

Each row's first document starts from ``initial_state[row]`` instead of zero, and the state at each row's end (its
last document's) is returned. Rows run one at a time, each chunked from its own start, so the state is read at a
chunk start as any carried state is; the chunk padding after a row's last token joins its last document (zero q, k,
v, g, beta: exactly nothing is written or decayed), so the last chunk's end state is the state after the row's last
token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._chunked import compute_dtype, fake_chunk_states_and_inverses, saved_inverses
from .._scaffold import Path


def row_boundaries(cu_seqlens: Tensor, row: int, length: int, chunk: int) -> Tensor:
    """``cu_seqlens`` (over rows of ``length`` flattened) as the boundaries of row ``row`` alone, its last document
    extended over the chunk padding: documents of other rows become empty. Tensor ops only (no host read)."""
    local = (cu_seqlens - row * length).clamp(0, length)
    return torch.where(local == length, -(-length // chunk) * chunk, local)


def stateless_forward(chunks_of, run, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale):
    """A delta rule's forward from a zero state at every document start: ``(o, [states, inverses])``, the output in
    q's dtype, the state at every chunk start and every chunk's ``A^-1``, flat (the compiler specialises a size-1
    dimension: a chunk-count dimension would cost one recompile for every batch of at most one chunk)."""
    c = chunks_of(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)
    o, states = run(c)
    return c.tokens(o).reshape(v.shape).to(q.dtype), [states.view(-1), c.A_inv.reshape(-1)]


def stateless_backward(chunks_of, backward_of, do, saved, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, chunk):
    """The gradients of :func:`stateless_forward`'s inputs: the chunks rebuilt with the saved ``A^-1``."""
    flat_states, flat_inverses = saved
    c = chunks_of(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, saved_inverses(flat_inverses, q, v, chunk))
    states = flat_states.view(*c.u.shape[:3], c.w.shape[-1], c.u.shape[-1])  # [NC, H, G, K, V]
    grads, _ = backward_of(c, states, do, scale)
    return tuple(d.reshape(x.shape) for d, x in zip(grads, (q, k, v, g, beta)))


def state_forward(chunks_of, run, q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale, chunk):
    """A delta rule's forward with a state, row by row: ``chunks_of(*row_inputs, bounds, use_qk_l2norm, scale,
    a_inv, reads_initial=True)`` cuts a row into chunks, ``run(c, initial)`` returns its chunked output and its
    states (at every chunk start, then the final one). ``(o, final_state, [states, inverses])``: the output
    ``[B, T, HV, V]`` in q's dtype, each row's final state ``[B, HV, K, V]`` in the compute dtype; per row, the
    state at every chunk start and every chunk's ``A^-1``, flat."""
    outputs, finals, saved_states, saved_inverses = [], [], [], []
    for row in range(q.shape[0]):
        c = _row_chunks(chunks_of, row, (q, k, v, g, beta), cu_seqlens, use_qk_l2norm, scale, chunk)
        o, states = run(c, initial_state[row].to(c.dtype).view(c.H, c.G, *initial_state.shape[2:]))
        outputs.append(c.tokens(o))
        finals.append(states[-1].reshape(initial_state.shape[1:]))
        saved_states.append(states[:-1].reshape(-1))
        saved_inverses.append(c.A_inv.reshape(-1))
    saved = [torch.cat(saved_states), torch.cat(saved_inverses)]
    return torch.stack(outputs).to(q.dtype), torch.stack(finals), saved


def state_fake(q, v, chunk: int):
    rows, length, value_heads, value_dim = v.shape
    key_dim, chunks, dtype = q.shape[3], -(-length // chunk), compute_dtype(q)
    o = v.new_empty(v.shape, dtype=q.dtype)
    final = q.new_empty(rows, value_heads, key_dim, value_dim, dtype=dtype)
    states = q.new_empty(rows * chunks * value_heads * key_dim * value_dim, dtype=dtype)
    inverses = q.new_empty(rows * chunks * value_heads * chunk * chunk, dtype=dtype)
    return o, final, [states, inverses]


def state_backward(chunks_of, backward_of, do, d_final, saved, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale,
                   chunk):
    """The gradients of :func:`state_forward`'s inputs, row by row; ``backward_of(c, states, do, scale, d_final)``
    returns a row's token gradients and that of its initial state."""
    rows, length, value_heads, value_dim = v.shape
    key_dim, chunks = q.shape[3], -(-length // chunk)
    states_per_row, inverses_per_row = (x.view(rows, -1) for x in saved)
    grads, d_initial = [], []
    for row in range(rows):
        a_inv = saved_inverses(inverses_per_row[row], q[:1], v[:1], chunk)
        c = _row_chunks(chunks_of, row, (q, k, v, g, beta), cu_seqlens, use_qk_l2norm, scale, chunk, a_inv)
        states = states_per_row[row].view(chunks, c.H, c.G, key_dim, value_dim)
        d_final_row = d_final[row].to(c.dtype).reshape(c.H, c.G, key_dim, value_dim)
        row_grads, d_initial_row = backward_of(c, states, do[row : row + 1], scale, d_final_row)
        grads.append(row_grads)
        d_initial.append(d_initial_row.reshape(value_heads, key_dim, value_dim))
    inputs = (q, k, v, g, beta)
    grads = [torch.cat([row[i] for row in grads]).reshape(x.shape) for i, x in enumerate(inputs)]
    return (*grads, torch.stack(d_initial))


def _row_chunks(chunks_of, row, inputs, cu_seqlens, use_qk_l2norm, scale, chunk, a_inv=None):
    bounds = row_boundaries(cu_seqlens, row, inputs[0].shape[1], chunk)
    return chunks_of(*(x[row : row + 1] for x in inputs), bounds, use_qk_l2norm, scale, a_inv, reads_initial=True)


def reference_paths(chunks_of, run, backward_of, chunk: int) -> tuple[Path, Path]:
    """A delta rule's ``*_varlen`` and ``*_varlen_state`` paths from its chunk builder ``chunks_of``, its ``run(c,
    initial=None)`` (the chunked output and the state at every chunk start, then the final one when ``initial`` is
    given) and its ``backward_of(c, states, do, scale, d_final=None)`` (each rule's ``reference.py``)."""

    def forward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale):
        return stateless_forward(chunks_of, run, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)

    def fake(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale):
        return fake_chunk_states_and_inverses(q, v, chunk)

    def backward(do, o, saved, needs_grad, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale):
        return stateless_backward(chunks_of, backward_of, do, saved, q, k, v, g, beta, cu_seqlens, use_qk_l2norm,
                                  scale, chunk)

    return Path(forward=forward, backward=backward, fake=fake), state_path(chunks_of, run, backward_of, chunk)


def state_path(chunks_of, run, backward_of, chunk: int) -> Path:
    """The ``*_varlen_state`` op's path for a delta rule (:func:`reference_paths`)."""

    def forward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, use_qk_l2norm, scale):
        return state_forward(chunks_of, run, q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale, chunk)

    def fake(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, use_qk_l2norm, scale):
        return state_fake(q, v, chunk)

    def backward(do, d_final, out, saved, needs_grad, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state,
                 use_qk_l2norm, scale):
        return state_backward(chunks_of, backward_of, do, d_final, saved, q, k, v, g, beta, cu_seqlens,
                              use_qk_l2norm, scale, chunk)

    return Path(forward=forward, backward=backward, fake=fake)
