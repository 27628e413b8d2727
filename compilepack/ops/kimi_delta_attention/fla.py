"""Kimi delta attention on CUDA through flash-linear-attention's own forward/backward functions.

Read in fla-core 0.6.0 (``fla/ops/kda/chunk.py``): ``l2norm_fwd``/``l2norm_bwd`` and ``chunk_kda_fwd``/
``chunk_kda_bwd``, saving what fla's ``ChunkKDAFunction`` saves (fla's backward recomputes its ``w, u, h`` in its
own kernels, as fla's autograd does by default); no forward is re-run in Python. Chunk indices are built from
the host copy of the boundaries (see ``ops/_delta_rule/fla.py``). fla asserts ``K <= 256``: larger key heads run the
reference, on CUDA too (:func:`applies`).
"""

from __future__ import annotations

import torch

from .. import backends
from .._delta_rule.fla import chunk_indices, fla_paths, flat_row, kernel_device

FLA_CHUNK = 64  # fla's default KDA chunk size (what the saved Aqk, Akk are shaped by)
FLA_MODULE = "fla.ops.kda.chunk"  # holds chunk_kda_fwd/bwd and imports l2norm_fwd/bwd + prepare_chunk_indices
FLA_MAX_K = 256  # chunk_kda asserts K <= 256


def applies(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale) -> bool:
    """Whether fla can run these inputs (a static fact: the key head dim)."""
    return q.shape[-1] <= FLA_MAX_K


def state_applies(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, use_qk_l2norm, scale) -> bool:
    """:func:`applies` for the state op."""
    return q.shape[-1] <= FLA_MAX_K


def forward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale, initial_state=None):
    """fla's forward: ``(o, final states per document or None, saved)``; from ``initial_state`` ``[N, HV, K, V]``
    (one per document, float32 as fla asserts) when given, which also asks for the final states."""
    fla = backends.load(FLA_MODULE)
    rows = [flat_row(x) for x in (q, k, v, g, beta)]
    cu_seqlens = cu_seqlens.to(torch.int32)
    saved = []
    with kernel_device(q):
        for i in (0, 1) if use_qk_l2norm else ():  # fla normalises q and k before the chunk kernels
            rows[i], rstd = fla.l2norm_fwd(rows[i])
            saved += [rows[i], rstd]
        q1, k1, v1, g1, beta1 = rows
        o, final, g_cum, Aqk, Akk = fla.chunk_kda_fwd(
            q=q1, k=k1, v=v1, g=g1, beta=beta1, scale=scale, initial_state=initial_state,
            output_final_state=initial_state is not None, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices(fla, cu_seqlens, cu_seqlens_cpu, FLA_CHUNK), chunk_size=FLA_CHUNK,
        )[:5]
    saved += [g_cum, Aqk, Akk]
    return o.view(v.shape).to(q.dtype), final, [x.view(*q.shape[:2], *x.shape[2:]) for x in saved]


def fake(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale):
    """What the stateless forward returns: fla's ChunkKDAFunction saves normalised q, k with their rstd, the chunk-local
    cumsum of g (fp32), Aqk and Akk."""
    per_head = q.shape[:3]
    norms = [[x.new_empty(x.shape), x.new_empty(per_head, dtype=torch.float32)] for x in (q, k)]
    chunk_matrices = [k.new_empty(*v.shape[:3], FLA_CHUNK) for _ in ("Aqk", "Akk")]
    saved = sum(norms if use_qk_l2norm else [], []) + [g.new_empty(g.shape, dtype=torch.float32), *chunk_matrices]
    return v.new_empty(v.shape, dtype=q.dtype), saved


def backward(do, saved, q, k, v, beta, cu_seqlens, cu_seqlens_cpu, use_qk_l2norm, scale, initial_state=None,
             d_final=None):
    """fla's backward: ``(dq, dk, dv, dg, dbeta, d_initial)``; ``initial_state`` and ``d_final`` (the final states'
    gradient) one per document, as :func:`forward` took them."""
    fla = backends.load(FLA_MODULE)
    saved = [flat_row(x) for x in saved]
    g_cum, Aqk, Akk = saved[-3:]
    unit_q, q_rstd, unit_k, k_rstd = saved[:4] if use_qk_l2norm else (flat_row(q), None, flat_row(k), None)
    cu_seqlens = cu_seqlens.to(torch.int32)
    with kernel_device(q):
        dq, dk, dv, dbeta, dg, d_initial = fla.chunk_kda_bwd(
            q=unit_q, k=unit_k, v=flat_row(v), beta=flat_row(beta), Aqk=Aqk, Akk=Akk, scale=scale,
            initial_state=initial_state, do=flat_row(do), dht=d_final, g=g_cum, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices(fla, cu_seqlens, cu_seqlens_cpu, FLA_CHUNK), chunk_size=FLA_CHUNK,
        )[:6]
        if use_qk_l2norm:
            dq, dk = fla.l2norm_bwd(unit_q, q_rstd, dq), fla.l2norm_bwd(unit_k, k_rstd, dk)
    return dq, dk, dv, dg, dbeta, d_initial


# ``compilepack::*_varlen`` and ``*_varlen_state`` (one state per row in and out, fla one per document)
PATH, PATH_STATE = fla_paths(forward, fake, backward)
