"""Glue shared by the delta rules that call flash-linear-attention (gated delta rule, Kimi delta attention).

fla >= 0.6 (read in fla-core 0.6.0): its varlen mode wants one packed row, launches kernels on the current CUDA
device, and builds chunk indices from the boundaries; from device ``cu_seqlens`` alone that is a device-to-host
copy per call, so the host copy the patch carries from the collator (``cu_seqlens_cpu``) is handed over too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .._chunked import compute_dtype
from .._scaffold import Path


def flat_row(x: Tensor) -> Tensor:
    """``[B, T, ...]`` -> ``[1, B*T, ...]`` contiguous: fla's varlen mode wants one packed row."""
    return x.reshape(1, -1, *x.shape[2:]).contiguous()


def kernel_device(x: Tensor):
    """fla launches kernels on the current device; make it the tensors' device (as fla's ``input_guard`` does)."""
    return torch.cuda.device(x.device.index) if x.is_cuda else contextlib.nullcontext()


def chunk_indices(fla, cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None, chunk_size: int) -> Tensor:
    """fla's ``[n_chunks, 2]`` chunk indices; read from the host copy of the boundaries when there is one."""
    return fla.prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


def fla_paths(forward, fake, backward) -> tuple[Path, Path]:
    """A delta rule's two paths on fla, without and with a state, from its glue: ``forward(*inputs,
    initial_state=None)`` -> ``(o, final states per document or None, saved)``; ``fake(*inputs)`` -> ``(o, saved)``;
    ``backward(do, saved, q, k, v, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale, initial_state=None,
    d_final=None)`` -> ``(dq, dk, dv, dg, dbeta, d_initial)``."""

    def stateless_forward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale):
        o, _, saved = forward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale)
        return o, saved

    def stateless_backward(do, o, saved, needs_grad, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm,
                           scale):
        return backward(do, saved, q, k, v, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale)[:5]

    stateless = Path(forward=stateless_forward, backward=stateless_backward, fake=fake)
    return stateless, state_path(forward, fake, backward)


# ------------------------------------------------------------------------------------------------ with a state
#
# The ``*_varlen_state`` ops (context parallelism over tokens) give one state per row: each row's first document
# starts from ``initial_state[row]`` and the state after each row's last token is returned. fla's varlen mode takes
# and returns one state per document (``[N, H, K, V]``, N = len(cu_seqlens) - 1). The documents holding each row's
# first and last token are found with ``searchsorted`` on the device boundaries: tensor ops, no host read. Empty
# documents (repeated boundaries) never hold a token, so they are never chosen and start from zero.


def row_documents(cu_seqlens: Tensor, rows: int, length: int) -> tuple[Tensor, Tensor]:
    """``(first, last)``: the index of the document that holds each row's first token and that of its last token
    (``[rows]`` each), for rows of ``length`` tokens flattened into ``cu_seqlens``."""
    row_starts = torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype) * length
    first = torch.searchsorted(cu_seqlens, row_starts, right=True) - 1
    last = torch.searchsorted(cu_seqlens, row_starts + (length - 1), right=True) - 1
    return first, last


def document_states(row_states: Tensor, documents: Tensor, count: int) -> Tensor:
    """``[count, ...]`` zeros with ``row_states[row]`` at ``documents[row]``: one state per document for fla, from
    one per row (the initial states, or the final states' gradients)."""
    per_document = row_states.new_zeros(count, *row_states.shape[1:])
    return per_document.index_copy(0, documents.long(), row_states)


def state_path(forward, fake, backward) -> Path:
    """A delta rule's ``*_varlen_state`` path on fla from its glue, returning ``(o, final_state, saved)``:
    ``forward(*inputs, initial_state)`` -> ``(o, final per document, saved)``; ``fake(*inputs)`` -> ``(o, saved)``;
    ``backward(do, saved, q, k, v, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale, initial_state, d_final)``
    -> ``(dq, dk, dv, dg, dbeta, d_initial)``, states one per document. fla's own backward gives the initial states'
    gradient."""

    def state_forward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, use_qk_l2norm, scale):
        first, last = row_documents(cu_seqlens, *q.shape[:2])
        h0 = document_states(initial_state.float(), first, cu_seqlens.shape[0] - 1)  # fla's states are float32
        o, final_per_document, saved = forward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale, h0)
        final = final_per_document.index_select(0, last.long())  # each row's last document's
        return o, final.to(compute_dtype(q)), saved

    def state_fake(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, use_qk_l2norm, scale):
        o, saved = fake(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale)
        return o, q.new_empty(initial_state.shape, dtype=compute_dtype(q)), saved

    def state_backward(do, d_final, out, saved, needs_grad, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu,
                       initial_state, use_qk_l2norm, scale):
        first, last = row_documents(cu_seqlens, *q.shape[:2])
        documents = cu_seqlens.shape[0] - 1
        h0 = document_states(initial_state.float(), first, documents)
        dht = document_states(d_final.float(), last, documents)
        *grads, d_h0 = backward(do.to(q.dtype), saved, q, k, v, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm,
                                scale, h0, dht)
        return (*grads, d_h0.index_select(0, first.long()))

    return Path(forward=state_forward, backward=state_backward, fake=state_fake)
