"""The gated delta rule on CUDA through flash-linear-attention's own forward/backward functions.

Read in fla-core 0.6.0 (``fla/ops/gated_delta_rule/chunk.py``): ``l2norm_fwd``/``l2norm_bwd`` and
``chunk_gated_delta_rule_fwd``/``chunk_gated_delta_rule_bwd``, saving what fla's autograd Function saves, so nothing
is recomputed. Chunk indices are built from the host copy of the boundaries (see ``ops/_delta_rule/fla.py``).
"""

from __future__ import annotations

import torch

from .. import backends
from .._delta_rule.fla import chunk_indices, fla_paths, flat_row, kernel_device

FLA_CHUNK = 64  # transformers' and fla's default chunk size (what the saved A is shaped by)
FLA_MODULE = "fla.ops.gated_delta_rule.chunk"  # holds the fwd/bwd functions and imports l2norm + chunk indices


def forward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale, initial_state=None):
    """fla's forward: ``(o, final states per document or None, saved)``; from ``initial_state`` ``[N, HV, K, V]``
    (one per document) when given, which also asks for the final states."""
    fla = backends.load(FLA_MODULE)
    q1, k1, v1, g1, beta1 = (flat_row(x) for x in (q, k, v, g, beta))
    cu_seqlens = cu_seqlens.to(torch.int32)
    with kernel_device(q):
        norms = []
        if use_qk_l2norm:
            q1, q_rstd = fla.l2norm_fwd(q1)
            k1, k_rstd = fla.l2norm_fwd(k1)
            norms = [q1, q_rstd, k1, k_rstd]
        g_cum, o, A, final = fla.chunk_gated_delta_rule_fwd(
            q=q1, k=k1, v=v1, g=g1, beta=beta1, scale=scale, initial_state=initial_state,
            output_final_state=initial_state is not None, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices(fla, cu_seqlens, cu_seqlens_cpu, FLA_CHUNK),
        )[:4]
    B, T = q.shape[:2]
    saved = [x.view(B, T, *x.shape[2:]) for x in norms] + [g_cum.view(g.shape), A.view(*v.shape[:3], FLA_CHUNK)]
    return o.view(v.shape).to(q.dtype), final, saved


def fake(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale):
    """What the stateless forward returns: fla's autograd Function saves normalised q, k with their rstd, the
    chunk-local cumsum of g, and A."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    norms = []
    if use_qk_l2norm:
        for x in (q, k):
            norms += [x.new_empty(x.shape), x.new_empty(B, T, H, dtype=torch.float32)]
    saved = norms + [q.new_empty(B, T, HV, dtype=torch.float32), k.new_empty(B, T, HV, FLA_CHUNK)]
    return v.new_empty(v.shape, dtype=q.dtype), saved


def backward(do, saved, q, k, v, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale, initial_state=None,
             d_final=None):
    """fla's backward: ``(dq, dk, dv, dg, dbeta, d_initial)``; ``initial_state`` and ``d_final`` (the final states'
    gradient) one per document, as :func:`forward` took them."""
    fla = backends.load(FLA_MODULE)
    v1, beta1, do1 = (flat_row(x) for x in (v, beta, do))
    *norms, g_cum, A = (flat_row(x) for x in saved)
    q1, q_rstd, k1, k_rstd = norms if use_qk_l2norm else (flat_row(q), None, flat_row(k), None)
    cu_seqlens = cu_seqlens.to(torch.int32)
    with kernel_device(q):
        dq, dk, dv, dbeta, dg, d_initial = fla.chunk_gated_delta_rule_bwd(
            q=q1, k=k1, v=v1, g=g_cum, beta=beta1, A=A, scale=scale, initial_state=initial_state, do=do1,
            dht=d_final, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices(fla, cu_seqlens, cu_seqlens_cpu, FLA_CHUNK),
        )[:6]
        if use_qk_l2norm:
            dq = fla.l2norm_bwd(q1, q_rstd, dq)
            dk = fla.l2norm_bwd(k1, k_rstd, dk)
    return dq, dk, dv, dg, dbeta, d_initial


# ``compilepack::*_varlen`` and ``*_varlen_state`` (one state per row in and out, fla one per document)
PATH, PATH_STATE = fla_paths(forward, fake, backward)
