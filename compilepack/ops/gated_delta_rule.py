"""Chunked gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) on packed rows, as one custom op.

The recurrent state restarts from zero at every document start, so a packed row gives each document exactly the
output it gets when run alone. The reference is transformers' chunked algorithm (chunk size 64) with per-token
document masks: cross-document pairs inside a chunk are masked out of the UT system and the intra-chunk
attention, and the state read, write and carry are masked at document starts. The chunk loop lives inside the
custom op, so the compiler never unrolls it (the stock function recompiles for every new length).

The backward is explicit: the forward saves the state at the start of every chunk; the backward recomputes the
cheap chunk-parallel quantities, runs one reverse loop over chunks for the state gradient (two small matmuls per
chunk, no autograd), and derives every input gradient with batched matmuls.

On CUDA with ``backend="fla"`` the op calls flash-linear-attention's own low-level functions (fla >= 0.5; read in
0.6.0, ``fla/ops/gated_delta_rule/chunk.py``): ``l2norm_fwd``/``l2norm_bwd`` and
``chunk_gated_delta_rule_fwd``/``chunk_gated_delta_rule_bwd``, saving what fla's autograd Function saves, so
nothing is recomputed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from compilepack import backends
from compilepack.ops._chunked import from_chunks, l2norm, l2norm_backward, to_chunks
from compilepack.ops._common import seq_idx_from_cu_seqlens

# The reference's chunk: exact for any value. Its [C, C] pair tensors cost T * C per op and the backward's
# elementwise passes over them dominate a CPU step, while the sequential chunk loop costs T / C steps. Measured on
# a bench-like row (8158 tokens, 56 lognormal documents, H=4, HV=8, K=V=32, 2 threads): backward 128 ms at 32,
# 191 ms at 64, 109-145 ms at 16 (more loop steps); forward 48-53 ms at all three.
CHUNK = 32
FLA_CHUNK = 64  # transformers' and fla's default chunk size (what the saved A of the kernel path is shaped by)
FLA_MODULE = "fla.ops.gated_delta_rule.chunk"  # holds the fwd/bwd functions and imports l2norm + chunk indices


def gated_delta_rule_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    *,
    backend: str = "reference",
) -> Tensor:
    """Gated delta rule over packed documents; the recurrent state is zero at every document start.

    Args:
        q: queries ``[B, T, H, K]`` (fla layout), any float dtype.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, HV, V]``; ``HV`` a multiple of ``H``: each q/k head serves ``HV // H`` consecutive
            value heads (grouped value attention, as ``repeat_interleave`` in transformers).
        g: log decay ``[B, T, HV]`` (entries <= 0): the state is multiplied by ``exp(g)`` at each token.
        beta: write strength ``[B, T, HV]``.
        cu_seqlens: ``int32`` (or ``int64``) ``[N+1]`` document boundaries over the flattened ``B * T`` tokens,
            starting at 0. With ``B > 1`` every row edge must also be a document edge. Zero-length documents
            (repeated values) are allowed.
        use_qk_l2norm: L2-normalise q and k over ``K`` inside the op (eps 1e-6, as transformers and fla).
        scale: query scale; ``K ** -0.5`` when None.
        backend: the CUDA library used when the tensors are on CUDA (``"fla"``) or ``"reference"``.

    Returns:
        o: ``[B, T, HV, V]`` in q's dtype (computed in fp32 on the reference path).
    """
    _check_shapes(q, k, v, g, beta, cu_seqlens)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    o, _ = _gated_delta_rule_op(q, k, v, g, beta, cu_seqlens, bool(use_qk_l2norm), scale, backend)
    return o


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor) -> None:
    """Shape and dtype checks only: nothing here reads tensor data, so it traces without guards on values."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, heads, head_dim], got shape {tuple(x.shape)}.")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [B, T, H, K], got {tuple(k.shape)}.")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T = {tuple(q.shape[:2])}, got {tuple(v.shape)}.")
    if v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"v's head count HV={v.shape[2]} must be a multiple of q's H={q.shape[2]}.")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(f"{name} must be [B, T, HV] = {tuple(v.shape[:3])}, got {tuple(x.shape)}.")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {x.dtype}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor [N+1], got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}."
        )


# ---------------------------------------------------------------------------------------------------------------
# Custom ops: forward (output + what the backward needs) and backward.
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("compilepack::gated_delta_rule_varlen", mutates_args=())
def _gated_delta_rule_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    use_qk_l2norm: bool,
    scale: float,
    backend: str,
) -> tuple[Tensor, list[Tensor]]:
    """Returns ``o`` and the tensors the backward needs (which ones depends on the path, see ``_saved_like``)."""
    if backends.use_kernel(q, backend):
        return _kernel_forward(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)
    return _reference_forward(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)


@_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, backend):
    return v.new_empty(v.shape, dtype=q.dtype), _saved_like(q, k, v, use_qk_l2norm, backend)


def _saved_like(q: Tensor, k: Tensor, v: Tensor, use_qk_l2norm: bool, backend: str) -> list[Tensor]:
    """Empty tensors shaped like what each path saves (decided from static facts, like the dispatch)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if backends.use_kernel(q, backend):
        # fla's autograd Function saves: normalised q, k with their rstd, the chunk-local cumsum of g, A
        norms = [q.new_empty(q.shape), q.new_empty(B, T, H, dtype=torch.float32)] if use_qk_l2norm else []
        norms += [k.new_empty(k.shape), k.new_empty(B, T, H, dtype=torch.float32)] if use_qk_l2norm else []
        return norms + [q.new_empty(B, T, HV, dtype=torch.float32), k.new_empty(B, T, HV, FLA_CHUNK)]
    n_chunks = (B * T + CHUNK - 1) // CHUNK
    return [q.new_empty(n_chunks * HV * K * V, dtype=torch.float32)]  # the state at every chunk start, flat


@torch.library.custom_op("compilepack::gated_delta_rule_varlen_backward", mutates_args=())
def _gated_delta_rule_backward_op(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    saved: list[Tensor],
    use_qk_l2norm: bool,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dg, dbeta)``, each contiguous, shaped and typed like its input."""
    if backends.use_kernel(q, backend):
        return _kernel_backward(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale)
    return _reference_backward(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale)


@_gated_delta_rule_backward_op.register_fake
def _(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale, backend):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, backend = inputs
    _, saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the saved tensors (o is the only one used)
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, *saved)
    ctx.use_qk_l2norm, ctx.scale, ctx.backend = use_qk_l2norm, scale, backend


def _backward(ctx, grad_o, _grad_saved):
    q, k, v, g, beta, cu_seqlens, *saved = ctx.saved_tensors
    dq, dk, dv, dg, dbeta = _gated_delta_rule_backward_op(
        grad_o, q, k, v, g, beta, cu_seqlens, saved, ctx.use_qk_l2norm, ctx.scale, ctx.backend
    )
    return dq, dk, dv, dg, dbeta, None, None, None, None


_gated_delta_rule_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# Reference (pure torch, fp32, any device). Layout inside: chunks first, [NC, H, G, C, D], G = HV // H value heads
# per q/k head; q/k quantities keep a size-1 G axis, so q k^T and k k^T are computed once per q/k head.
# ---------------------------------------------------------------------------------------------------------------


def _to_chunks(x_TD: Tensor, n_chunks: int) -> Tensor:
    return to_chunks(x_TD, n_chunks, CHUNK)


class _Chunks:
    """Everything chunk-parallel (no recurrence), computed once in the forward and recomputed in the backward.

    Per chunk, with gamma the in-chunk cumulative log decay and masks from the document id of each token:
    ``decay[i, j] = exp(gamma_i - gamma_j)`` for same-document ``j <= i`` (0 elsewhere);
    ``A = I + strict_lower(beta_i k_i.k_j decay[i, j])``; ``U = A^-1 (beta v)``; ``W = A^-1 (beta e k)`` with
    ``e_i = exp(gamma_i)`` where token i continues the document of the previous chunk (reads the state), else 0.
    The recurrence is then ``v_new = U - W S``; ``o = (q e) S + (q k^T * decay) v_new``;
    ``S' = carry * S + k_out^T v_new`` with ``k_out_j = k_j exp(gamma_C - gamma_j)`` for tokens j of the chunk's
    last document and ``carry = exp(gamma_C)`` when that document started before the chunk (else 0).
    """

    def __init__(self, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale):
        B, T, H, K = q.shape
        HV, V = v.shape[2:]
        self.total, self.n_chunks, self.H, self.G = B * T, (B * T + CHUNK - 1) // CHUNK, H, HV // H
        q_TK, self.q_rstd = l2norm(q.reshape(B * T, H, K).float(), use_qk_l2norm)
        k_TK, self.k_rstd = l2norm(k.reshape(B * T, H, K).float(), use_qk_l2norm)
        self.q_unit, self.k_unit = q_TK, k_TK  # normalised, unscaled: the l2norm backward needs them
        nc = self.n_chunks
        self.q = _to_chunks(q_TK * scale, nc).unsqueeze(2)  # [NC, H, 1, C, K]
        self.k = _to_chunks(k_TK, nc).unsqueeze(2)
        self.v = _to_chunks(v.reshape(B * T, H, self.G, V).float(), nc)  # [NC, H, G, C, V]
        self.beta = _to_chunks(beta.reshape(B * T, H, self.G, 1).float(), nc).squeeze(-1)  # [NC, H, G, C]
        g_chunks = _to_chunks(g.reshape(B * T, H, self.G, 1).float(), nc).squeeze(-1)
        self.gamma = g_chunks.cumsum(-1)
        self._masks(cu_seqlens)
        self._intra()

    def _masks(self, cu_seqlens: Tensor) -> None:
        # padding tokens past cu_seqlens[-1] get their own document id, so they never touch real tokens
        doc = seq_idx_from_cu_seqlens(cu_seqlens, self.n_chunks * CHUNK).view(self.n_chunks, CHUNK)
        prev_last = F.pad(doc[:-1, -1], (1, 0), value=-1)  # document of the token before each chunk
        causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=doc.device).tril()
        self.same_doc = (doc[:, :, None] == doc[:, None, :]) & causal  # [NC, C, C] -> broadcasts over H, G
        self.reads_state = (doc == prev_last[:, None])[:, None, None, :]  # [NC, 1, 1, C]
        self.in_last_doc = (doc == doc[:, -1:])[:, None, None, :]

    def _intra(self) -> None:
        gamma, gamma_last = self.gamma, self.gamma[..., -1:]
        pairwise = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~self.same_doc[:, None, None], -torch.inf)
        self.decay = pairwise.exp()  # [NC, H, G, C, C]
        self.e = gamma.exp() * self.reads_state  # [NC, H, G, C]
        self.out_decay = (gamma_last - gamma).exp() * self.in_last_doc
        self.carry = gamma_last.exp() * self.reads_state[..., -1:]  # [NC, H, G, 1]
        self.kk = self.k @ self.k.transpose(-1, -2)  # [NC, H, 1, C, C]
        self.qk = self.q @ self.k.transpose(-1, -2)
        self.A = (self.beta[..., None] * self.kk * self.decay).tril(-1) + torch.eye(CHUNK, device=gamma.device)
        self.bk = self.k * (self.beta * self.e)[..., None]  # [NC, H, G, C, K]
        rhs = torch.cat([self.v * self.beta[..., None], self.bk], -1)
        uw = torch.linalg.solve_triangular(self.A, rhs, upper=False, unitriangular=True)
        self.u, self.w = uw.split([self.v.shape[-1], self.k.shape[-1]], -1)
        self.qe = self.q * self.e[..., None]  # [NC, H, G, C, K]
        self.attn = self.qk * self.decay
        self.k_out = self.k * self.out_decay[..., None]


def _reference_forward(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale):
    c = _Chunks(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)
    states = _chunk_start_states(c.u, c.w, c.k_out, c.carry)
    v_new = c.u - c.w @ states
    o = c.qe @ states + c.attn @ v_new  # [NC, H, G, C, V]
    o = from_chunks(o.flatten(1, 2), c.total).reshape(v.shape).to(q.dtype)
    # flat, so the chunk count is never a dimension of its own: the compiler specialises a size-1 dimension,
    # which would cost one recompile for every batch of at most one chunk
    return o, [states.view(-1)]


def _chunk_start_states(u: Tensor, w: Tensor, k_out: Tensor, carry: Tensor) -> Tensor:
    """The recurrent state at the start of every chunk, ``[NC, H, G, K, V]`` (zero before the first chunk)."""
    n_chunks = u.shape[0]
    states = u.new_empty(*u.shape[:3], w.shape[-1], u.shape[-1])
    states[0].zero_()
    k_out_t = k_out.transpose(-1, -2)
    for i in range(n_chunks - 1):
        v_new = u[i] - w[i] @ states[i]
        torch.addcmul(k_out_t[i] @ v_new, carry[i][..., None], states[i], out=states[i + 1])
    return states


def _reference_backward(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale):
    (flat_states,) = saved
    c = _Chunks(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)
    states = flat_states.view(*c.u.shape[:3], c.w.shape[-1], c.u.shape[-1])  # [NC, H, G, K, V]
    do_c = _to_chunks(do.reshape(c.total, c.H, c.G, -1).float(), c.n_chunks)  # [NC, H, G, C, V]
    v_new = c.u - c.w @ states
    d_states_end = _chunk_end_state_grads(do_c, c)  # dL/dS' for every chunk
    d_v_new = c.attn.transpose(-1, -2) @ do_c + c.k_out @ d_states_end
    d_w = -(d_v_new @ states.transpose(-1, -2))
    d_qe = do_c @ states.transpose(-1, -2)
    d_attn = do_c @ v_new.transpose(-1, -2)
    d_k_out = v_new @ d_states_end.transpose(-1, -2)
    d_carry = (states * d_states_end).sum((-2, -1))[..., None]  # [NC, H, G, 1]

    # through U, W = A^-1 [beta v, beta e k]: d rhs = A^-T [dU, dW]; dA = -(d rhs) [U, W]^T on the strict lower part
    d_rhs = torch.linalg.solve_triangular(
        c.A.transpose(-1, -2), torch.cat([d_v_new, d_w], -1), upper=True, unitriangular=True
    )
    d_bv, d_bk = d_rhs.split([c.v.shape[-1], c.k.shape[-1]], -1)
    d_A = -(d_bv @ c.u.transpose(-1, -2) + d_bk @ c.w.transpose(-1, -2)).tril(-1)

    # A = beta_i kk_ij decay_ij (strict lower), attn = qk_ij decay_ij
    # each [C, C] product is formed once and reused: on CPU these elementwise passes dominate the backward
    d_A_decay = d_A * c.decay
    d_attn_decay = d_attn * c.decay
    d_beta = (d_A_decay * c.kk).sum(-1) + (d_bv * c.v).sum(-1) + (d_bk * c.k).sum(-1) * c.e
    d_kk_pairs = d_A_decay * c.beta[..., None]
    d_kk = d_kk_pairs.sum(2, keepdim=True)
    d_qk = d_attn_decay.sum(2, keepdim=True)
    d_decay_x_decay = torch.addcmul(d_kk_pairs * c.kk, d_attn_decay, c.qk)
    d_gamma = d_decay_x_decay.sum(-1) - d_decay_x_decay.sum(-2)
    d_gamma = d_gamma + (d_qe * c.qe).sum(-1) + (d_bk * c.bk).sum(-1)
    d_k_out_x_k_out = (d_k_out * c.k_out).sum(-1)
    d_gamma = d_gamma - d_k_out_x_k_out
    d_gamma[..., -1:] += d_k_out_x_k_out.sum(-1, keepdim=True) + d_carry * c.carry

    d_q = d_qk @ c.k + (d_qe * c.e[..., None]).sum(2, keepdim=True)
    d_k = (d_kk + d_kk.transpose(-1, -2)) @ c.k + d_qk.transpose(-1, -2) @ c.q
    d_k = d_k + (d_bk * (c.beta * c.e)[..., None] + d_k_out * c.out_decay[..., None]).sum(2, keepdim=True)
    d_v = d_bv * c.beta[..., None]
    d_g = d_gamma.flip(-1).cumsum(-1).flip(-1)  # gamma is a cumsum of g within the chunk

    d_q = l2norm_backward(from_chunks(d_q.squeeze(2), c.total) * scale, c.q_unit, c.q_rstd)
    d_k = l2norm_backward(from_chunks(d_k.squeeze(2), c.total), c.k_unit, c.k_rstd)
    return (
        d_q.reshape(q.shape).to(q.dtype),
        d_k.reshape(k.shape).to(k.dtype),
        from_chunks(d_v.flatten(1, 2), c.total).reshape(v.shape).to(v.dtype),
        from_chunks(d_g.flatten(1, 2)[..., None], c.total).reshape(g.shape).to(g.dtype),
        from_chunks(d_beta.flatten(1, 2)[..., None], c.total).reshape(beta.shape).to(beta.dtype),
    )


def _chunk_end_state_grads(do_c: Tensor, c: _Chunks) -> Tensor:
    """Reverse loop: the gradient of the loss w.r.t. the state at the end of every chunk (zero after the last)."""
    # per chunk: dv_new = attn^T do + k_out dS';  dS = (q e)^T do - W^T dv_new + carry dS'
    d_v_new_local = c.attn.transpose(-1, -2) @ do_c
    d_state_local = c.qe.transpose(-1, -2) @ do_c
    w_t = c.w.transpose(-1, -2)
    d_states_end = torch.empty_like(d_state_local)
    d_states_end[-1].zero_()
    for i in range(c.n_chunks - 1, 0, -1):
        d_v_new = d_v_new_local[i] + c.k_out[i] @ d_states_end[i]
        d_prev = torch.addcmul(d_state_local[i] - w_t[i] @ d_v_new, c.carry[i][..., None], d_states_end[i])
        d_states_end[i - 1].copy_(d_prev)
    return d_states_end


# ---------------------------------------------------------------------------------------------------------------
# CUDA path: flash-linear-attention's own forward/backward functions. Read in fla 0.6.0; the arguments used are
# the ones 0.5.x and 0.6.0 share (0.5 has no chunk_size argument, its default 64 is ours; 0.4 lacks chunk_indices).
# ---------------------------------------------------------------------------------------------------------------


def _device_guard(x: Tensor):
    """fla launches kernels on the current device; make it the tensors' device (as fla's ``input_guard`` does)."""
    return torch.cuda.device(x.device.index) if x.is_cuda else contextlib.nullcontext()


def _flat_row(x: Tensor) -> Tensor:
    """``[B, T, ...]`` -> ``[1, B*T, ...]`` contiguous: fla's varlen mode wants one packed row."""
    return x.reshape(1, -1, *x.shape[2:]).contiguous()


def _kernel_forward(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale):
    fla = backends.load(FLA_MODULE)
    q1, k1, v1, g1, beta1 = (_flat_row(x) for x in (q, k, v, g, beta))
    with _device_guard(q):
        norms = []
        if use_qk_l2norm:
            q1, q_rstd = fla.l2norm_fwd(q1)
            k1, k_rstd = fla.l2norm_fwd(k1)
            norms = [q1, q_rstd, k1, k_rstd]
        # fla builds chunk indices with a host sync (repeat_interleave on device counts); its tensor_cache keys
        # them on the cu_seqlens object, so layers sharing one cu_seqlens tensor pay it once per step.
        chunk_indices = fla.prepare_chunk_indices(cu_seqlens, FLA_CHUNK)
        g_cum, o, A = fla.chunk_gated_delta_rule_fwd(
            q=q1, k=k1, v=v1, g=g1, beta=beta1, scale=scale, initial_state=None, output_final_state=False,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        )[:3]
    B, T = q.shape[:2]
    saved = [x.view(B, T, *x.shape[2:]) for x in norms] + [g_cum.view(g.shape), A.view(*v.shape[:3], FLA_CHUNK)]
    return o.view(v.shape).to(q.dtype), saved


def _kernel_backward(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale):
    fla = backends.load(FLA_MODULE)
    v1, beta1, do1 = (_flat_row(x) for x in (v, beta, do))
    *norms, g_cum, A = (_flat_row(x) for x in saved)
    q1, q_rstd, k1, k_rstd = norms if use_qk_l2norm else (_flat_row(q), None, _flat_row(k), None)
    with _device_guard(q):
        chunk_indices = fla.prepare_chunk_indices(cu_seqlens, FLA_CHUNK)
        dq, dk, dv, dbeta, dg = fla.chunk_gated_delta_rule_bwd(
            q=q1, k=k1, v=v1, g=g_cum, beta=beta1, A=A, scale=scale, initial_state=None, do=do1, dht=None,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        )[:5]
        if use_qk_l2norm:
            dq = fla.l2norm_bwd(q1, q_rstd, dq)
            dk = fla.l2norm_bwd(k1, k_rstd, dk)
    return tuple(
        d.reshape(x.shape).to(x.dtype).contiguous() for d, x in ((dq, q), (dk, k), (dv, v), (dg, g), (dbeta, beta))
    )
