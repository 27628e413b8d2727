"""Kimi delta attention (KDA: Kimi Linear) on packed rows, as one custom op.

KDA is the gated delta rule with a per-channel decay: the state ``S`` (``K x V`` per value head) is multiplied
row-wise by ``exp(g_t)`` (``g_t`` a ``K``-vector) at every token before the delta-rule write. The recurrent
state restarts from zero at every document start, so a packed row gives each document exactly the output it
gets when run alone.

The reference is a masked chunked algorithm with the chunk loop inside the op (the compiler never unrolls
it). A per-channel decay does not factor out of the intra-chunk products the way a per-head scalar does:
``exp(G_i - G_j)`` (``G`` the in-chunk cumulative log decay) is a ``K``-vector for every token pair, so the
pair products ``sum_c x_ic y_jc exp(G_ic - G_jc)`` are formed elementwise over a ``[C, C, K]`` tensor, never
as ``(x e^G)(y e^-G)^T``, which overflows fp32 once a channel decays by more than ~88 nats inside a chunk.
That is also what transformers' torch fallback does, with chunk 64; the reference uses chunk 8 (exact for
any value): the elementwise tensor is 8x smaller and the state recurrence between chunks is a cheap loop
(measured on 2048 tokens, 4 heads of 64: chunk 8 is 1.2-1.3x faster than chunks 4 or 16, fwd+bwd).
Cross-document pairs are masked inside a chunk; the state read, write and carry are masked at document starts.

The backward is explicit: the forward saves the state at the start of every chunk and the delta-rule values
``v_new`` (both flat); the backward recomputes the chunk-parallel quantities, runs one reverse loop over chunks
for the state gradient, and derives every input gradient with batched products, no autograd.

On CUDA with ``backend="fla"`` the op calls flash-linear-attention's own low-level functions (fla >= 0.5; read
in fla-core 0.6.0 and 0.5.0, ``fla/ops/kda/chunk.py``): ``l2norm_fwd``/``l2norm_bwd`` and
``chunk_kda_fwd``/``chunk_kda_bwd``, saving what fla's ``ChunkKDAFunction`` saves (fla's backward recomputes its
``w, u, h`` in its own kernels, as fla's autograd does by default); no forward is re-run in Python.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from compilepack import backends
from compilepack.ops._chunked import from_chunks, l2norm, l2norm_backward, to_chunks
from compilepack.ops._common import seq_idx_from_cu_seqlens

CHUNK = 8  # the reference's chunk: exact for any value; small keeps the [C, C, K] pair tensors small
FLA_CHUNK = 64  # fla's default KDA chunk size (0.5 and 0.6 accept 32 or 64)
FLA_MODULE = "fla.ops.kda.chunk"  # holds chunk_kda_fwd/bwd and imports l2norm_fwd/bwd + prepare_chunk_indices
SERIAL_LOOP_MAX_WORK = 1 << 20  # multiply-adds per loop step below which the chunk loops run on one thread
FLA_MAX_K = 256  # fla's chunk_kda asserts K <= 256; larger key heads run the reference on CUDA too


def kimi_delta_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    backend: str = "reference",
) -> Tensor:
    """Kimi delta attention over packed documents; the recurrent state is zero at every document start.

    The layout is fla's ``chunk_kda`` (and transformers' ``chunk_kimi_delta_attention``), without an initial or
    final state.

    Args:
        q: queries ``[B, T, H, K]``, any float dtype.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, HV, V]``; ``HV`` a multiple of ``H``: each q/k head serves ``HV // H`` consecutive
            value heads (fla's grouped value attention; Kimi Linear has ``HV == H``).
        g: per-channel log decay ``[B, T, HV, K]`` (entries <= 0, already activated, as Kimi's forget gate
            returns it): row ``c`` of a head's state is multiplied by ``exp(g[..., c])`` at each token.
        beta: write strength ``[B, T, HV]`` (after the sigmoid).
        cu_seqlens: ``int32`` (or ``int64``) ``[N+1]`` document boundaries over the flattened ``B * T`` tokens,
            starting at 0. With ``B > 1`` every row edge must also be a document edge. Zero-length documents
            (repeated values) are allowed.
        scale: query scale; ``K ** -0.5`` when None (the only value transformers uses).
        use_qk_l2norm_in_kernel: L2-normalise q and k over ``K`` inside the op (eps 1e-6, as transformers and
            fla); Kimi Linear passes True.
        backend: the CUDA library used when the tensors are on CUDA (``"fla"``) or ``"reference"``.

    Returns:
        o: ``[B, T, HV, V]`` in q's dtype (computed in fp32 on the reference path).
    """
    _check_shapes(q, k, v, g, beta, cu_seqlens)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    o, _ = _kda_op(q, k, v, g, beta, cu_seqlens, bool(use_qk_l2norm_in_kernel), scale, backend)
    return o


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor) -> None:
    """Shape and dtype checks only: nothing here reads tensor data, so it traces without guards on values."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, heads, head_dim], got shape {tuple(x.shape)}.")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [B, T, H, K], got {tuple(k.shape)}.")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T = {tuple(q.shape[:2])}, got {tuple(v.shape)}.")
    if v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"v's head count HV={v.shape[2]} must be a multiple of q's H={q.shape[2]}.")
    expected_g = (*v.shape[:3], q.shape[3])
    if g.shape != expected_g:
        raise ValueError(f"g must be [B, T, HV, K] = {expected_g} (one decay per key channel), got {tuple(g.shape)}.")
    if beta.shape != v.shape[:3]:
        raise ValueError(f"beta must be [B, T, HV] = {tuple(v.shape[:3])}, got {tuple(beta.shape)}.")
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


@torch.library.custom_op("compilepack::kimi_delta_attention_varlen", mutates_args=())
def _kda_op(
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
    if _uses_fla(q, backend):
        return _kernel_forward(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)
    return _reference_forward(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)


def _uses_fla(q: Tensor, backend: str) -> bool:
    """Whether fla runs (decided from static facts: device type, backend name, key head dim)."""
    return backends.use_kernel(q, backend) and q.shape[-1] <= FLA_MAX_K


@_kda_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, backend):
    return v.new_empty(v.shape, dtype=q.dtype), _saved_like(q, k, v, use_qk_l2norm, backend)


def _saved_like(q: Tensor, k: Tensor, v: Tensor, use_qk_l2norm: bool, backend: str) -> list[Tensor]:
    """Empty tensors shaped like what each path saves (decided from static facts, like the dispatch)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if _uses_fla(q, backend):
        # fla's ChunkKDAFunction saves: normalised q, k with their rstd, the chunk-local cumsum of g, Aqk, Akk
        norms = [q.new_empty(q.shape), q.new_empty(B, T, H, dtype=torch.float32)] if use_qk_l2norm else []
        norms += [k.new_empty(k.shape), k.new_empty(B, T, H, dtype=torch.float32)] if use_qk_l2norm else []
        chunk_matrices = [k.new_empty(B, T, HV, FLA_CHUNK) for _ in ("Aqk", "Akk")]
        return norms + [q.new_empty(B, T, HV, K, dtype=torch.float32), *chunk_matrices]
    n_chunks = (B * T + CHUNK - 1) // CHUNK
    # flat, so the chunk count is never a dimension of its own: the compiler specialises a size-1 dimension,
    # which would cost one recompile for every batch of at most one chunk
    states = q.new_empty(n_chunks * HV * K * V, dtype=torch.float32)  # at every chunk start
    v_new = q.new_empty(n_chunks * HV * CHUNK * V, dtype=torch.float32)  # the delta-rule values, per token
    return [states, v_new]


@torch.library.custom_op("compilepack::kimi_delta_attention_varlen_backward", mutates_args=())
def _kda_backward_op(
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
    if _uses_fla(q, backend):
        return _kernel_backward(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale)
    return _reference_backward(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale)


@_kda_backward_op.register_fake
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
    dq, dk, dv, dg, dbeta = _kda_backward_op(
        grad_o, q, k, v, g, beta, cu_seqlens, saved, ctx.use_qk_l2norm, ctx.scale, ctx.backend
    )
    return dq, dk, dv, dg, dbeta, None, None, None, None


_kda_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# Reference (pure torch, fp32, any device). Layout inside: chunks first, [NC, H, G, C, D], G = HV // H value heads
# per q/k head; q/k keep a size-1 G axis. Pair tensors are [NC, H, G, C_i, C_j, K].
# ---------------------------------------------------------------------------------------------------------------


def _to_chunks(x_TD: Tensor, n_chunks: int) -> Tensor:
    return to_chunks(x_TD, n_chunks, CHUNK)


class _Chunks:
    """Everything chunk-parallel (no recurrence), computed once in the forward and recomputed in the backward.

    Per chunk, with ``G_i`` the in-chunk cumulative log decay (a K-vector) and masks from each token's document:
    ``D[i, j, c] = exp(G_ic - G_jc)`` for same-document ``j <= i`` (0 elsewhere); ``QK[i, j] = sum_c q_ic k_jc D_ijc``,
    ``KK`` likewise; ``A = I + strict_lower(beta_i KK_ij)``; ``U = A^-1 (beta v)``; ``W = A^-1 (beta k E)`` with
    ``E_i = exp(G_i)`` where token i continues the document of the previous chunk (reads the state), else 0.
    The recurrence is then ``v_new = U - W S``; ``o = (q E) S + QK v_new``; ``S' = carry * S + (k O)^T v_new``
    with ``O_j = exp(G_C - G_j)`` for tokens j of the chunk's last document (else 0) and the per-channel
    ``carry = exp(G_C)`` when that document started before the chunk (else 0).
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
        self.gamma = _to_chunks(g.reshape(B * T, H, self.G, K).float(), nc).cumsum(-2)  # [NC, H, G, C, K]
        self._masks(cu_seqlens)
        self._intra()

    def _masks(self, cu_seqlens: Tensor) -> None:
        # padding tokens past cu_seqlens[-1] get their own document id, so they never touch real tokens
        doc = seq_idx_from_cu_seqlens(cu_seqlens, self.n_chunks * CHUNK).view(self.n_chunks, CHUNK)
        prev_last = F.pad(doc[:-1, -1], (1, 0), value=-1)  # document of the token before each chunk
        causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=doc.device).tril()
        self.same_doc = (doc[:, :, None] == doc[:, None, :]) & causal  # [NC, C, C]
        self.reads_state = (doc == prev_last[:, None])[:, None, None, :, None]  # [NC, 1, 1, C, 1]
        self.in_last_doc = (doc == doc[:, -1:])[:, None, None, :, None]

    def _intra(self) -> None:
        gamma, gamma_last = self.gamma, self.gamma[..., -1:, :]
        self.decay = self._pair_decay()  # [NC, H, G, C, C, K]
        # masks applied to the exponents (-inf), so a masked term is an exact zero whatever its exponent
        self.e = gamma.masked_fill(~self.reads_state, -torch.inf).exp()  # [NC, H, G, C, K]
        self.out_decay = (gamma_last - gamma).masked_fill_(~self.in_last_doc, -torch.inf).exp_()
        self.carry = self.e[..., -1, :]  # exp(G_C) if the last token reads the state: [NC, H, G, K]
        self.k_decay = self.decay * self.k.unsqueeze(-3)  # k_j D_ijc
        self.qk = torch.einsum("nhgijc,nhxic->nhgij", self.k_decay, self.q)  # [NC, H, G, C, C]
        self.kk = torch.einsum("nhgijc,nhxic->nhgij", self.k_decay, self.k)
        eye = torch.eye(CHUNK, device=gamma.device)
        self.A = (self.beta[..., None] * self.kk).tril(-1) + eye
        self.ke = self.k * self.e  # [NC, H, G, C, K]
        self.bke = self.ke * self.beta[..., None]
        rhs = torch.cat([self.v * self.beta[..., None], self.bke], -1)
        uw = torch.linalg.solve_triangular(self.A, rhs, upper=False, unitriangular=True)
        self.u, self.w = uw.split([self.v.shape[-1], self.k.shape[-1]], -1)
        self.qe = self.q * self.e
        self.k_out = self.k * self.out_decay

    def _pair_decay(self) -> Tensor:
        gamma = self.gamma
        pairwise = gamma.unsqueeze(-2) - gamma.unsqueeze(-3)  # [..., i, j, K] = G_i - G_j
        # -inf before exp: masked pairs (j > i: a growing, possibly overflowing exponent) become exact zeros
        return pairwise.masked_fill_(~self.same_doc[:, None, None, :, :, None], -torch.inf).exp_()


def _reference_forward(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale):
    c = _Chunks(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)
    with _serial_if_small(c.u, c.w):
        states, v_new = _chunk_start_states(c.u, c.w, c.k_out, c.carry)
    o = c.qe @ states + c.qk @ v_new  # [NC, H, G, C, V]
    o = from_chunks(o.flatten(1, 2), c.total).reshape(v.shape).to(q.dtype)
    # flat, so the chunk count is never a dimension of its own (see _saved_like)
    return o, [states.view(-1), v_new.view(-1)]


@contextlib.contextmanager
def _serial_if_small(u: Tensor, w: Tensor):
    """Run a chunk loop on one intra-op thread when its per-step matmuls are small.

    Each step is a few ``[H*G, C, K] @ [H*G, K, V]`` products. Threading one that small gains nothing and adds a
    thread barrier per call, which costs milliseconds as soon as the cores are shared: measured on 2 loaded
    cores, 7.5 ms per call on 2 threads vs 3 us on one (the whole fwd+bwd: 9.0 s vs 1.4 s).
    """
    threads = torch.get_num_threads()
    step_work = u[0].numel() * w.shape[-1]  # one chunk's W S: H*G*C*V*K multiply-adds
    if threads == 1 or u.device.type != "cpu" or step_work >= SERIAL_LOOP_MAX_WORK:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _chunk_start_states(u: Tensor, w: Tensor, k_out: Tensor, carry: Tensor) -> tuple[Tensor, Tensor]:
    """The state at the start of every chunk ``[NC, H, G, K, V]`` (zero before the first) and ``v_new = U - W S``."""
    n_chunks, H, G = u.shape[:3]
    states = u.new_empty(n_chunks, H * G, w.shape[-1], u.shape[-1])
    states[0].zero_()
    # 3-D per-chunk views, so every step is one bmm-family call (the loop is per-call overhead bound)
    u, w, carry = u.flatten(1, 2), w.flatten(1, 2), carry.flatten(1, 2)[..., None]
    k_out_t = k_out.flatten(1, 2).transpose(-1, -2)
    v_new = u.new_empty(u.shape)
    for i in range(n_chunks):
        torch.baddbmm(u[i], w[i], states[i], alpha=-1, out=v_new[i])
        if i + 1 < n_chunks:
            torch.bmm(k_out_t[i], v_new[i], out=states[i + 1]).addcmul_(carry[i], states[i])
    return states.view(n_chunks, H, G, *states.shape[2:]), v_new.view(n_chunks, H, G, *v_new.shape[2:])


def _reference_backward(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale):
    flat_states, flat_v_new = saved
    c = _Chunks(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale)
    states = flat_states.view(*c.u.shape[:3], c.w.shape[-1], c.u.shape[-1])  # [NC, H, G, K, V]
    do_c = _to_chunks(do.reshape(c.total, c.H, c.G, -1).float(), c.n_chunks)  # [NC, H, G, C, V]
    v_new = flat_v_new.view(c.u.shape)  # [NC, H, G, C, V]
    with _serial_if_small(c.u, c.w):
        d_states_end = _chunk_end_state_grads(do_c, c)  # dL/dS' for every chunk
    d_v_new = c.qk.transpose(-1, -2) @ do_c + c.k_out @ d_states_end
    d_w = -(d_v_new @ states.transpose(-1, -2))
    d_qe = do_c @ states.transpose(-1, -2)  # [NC, H, G, C, K]
    d_qk = do_c @ v_new.transpose(-1, -2)  # [NC, H, G, C, C]
    d_k_out = v_new @ d_states_end.transpose(-1, -2)
    d_carry = torch.einsum("nhgkv,nhgkv->nhgk", states, d_states_end)  # diagonal of S dS'^T

    # through U, W = A^-1 [beta v, beta k E]: d rhs = A^-T [dU, dW]; dA = -(d rhs) [U, W]^T on the strict lower part
    d_rhs = torch.linalg.solve_triangular(
        c.A.transpose(-1, -2), torch.cat([d_v_new, d_w], -1), upper=True, unitriangular=True
    )
    d_bv, d_bke = d_rhs.split([c.v.shape[-1], c.k.shape[-1]], -1)
    d_A = -(d_bv @ c.u.transpose(-1, -2) + d_bke @ c.w.transpose(-1, -2)).tril(-1)
    d_beta = (d_A * c.kk).sum(-1) + (d_bv * c.v).sum(-1) + (d_bke * c.ke).sum(-1)
    d_kk = d_A * c.beta[..., None]

    d_q, d_k, d_gamma = _pair_grads(c, d_qk, d_kk)
    # E: q E (state read in o) and beta k E (state read in the UT system); O: the state write; carry
    d_bke_e = d_bke * c.e
    d_q = d_q + (d_qe * c.e).sum(2, keepdim=True)
    d_k = d_k + (d_bke_e * c.beta[..., None] + d_k_out * c.out_decay).sum(2, keepdim=True)
    d_k_out_x_k_out = d_k_out * c.k_out
    d_gamma = d_gamma + d_qe * c.qe + d_bke * c.bke - d_k_out_x_k_out
    d_gamma[..., -1, :] += d_k_out_x_k_out.sum(-2) + d_carry * c.carry
    d_v = d_bv * c.beta[..., None]
    d_g = d_gamma.flip(-2).cumsum(-2).flip(-2)  # gamma is a cumsum of g within the chunk

    d_q = l2norm_backward(from_chunks(d_q.squeeze(2), c.total) * scale, c.q_unit, c.q_rstd)
    d_k = l2norm_backward(from_chunks(d_k.squeeze(2), c.total), c.k_unit, c.k_rstd)
    return (
        d_q.reshape(q.shape).to(q.dtype),
        d_k.reshape(k.shape).to(k.dtype),
        from_chunks(d_v.flatten(1, 2), c.total).reshape(v.shape).to(v.dtype),
        from_chunks(d_g.flatten(1, 2), c.total).reshape(g.shape).to(g.dtype),
        from_chunks(d_beta.flatten(1, 2)[..., None], c.total).reshape(beta.shape).to(beta.dtype),
    )


def _pair_grads(c: _Chunks, d_qk: Tensor, d_kk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients through ``QK_ij = sum_c q_ic k_jc D_ijc`` and ``KK_ij = sum_c k_ic k_jc D_ijc``.

    Returns dq ``[NC, H, 1, C, K]`` (summed over G), dk (both roles, summed over G) and d gamma ``[NC, H, G, C, K]``.
    With ``Y_ijc = dQK_ij q_ic + dKK_ij k_ic``: row role ``dq_i = sum_j dQK_ij k_jc D_ijc`` (and dk_i alike),
    column role ``dk_j = sum_i Y_ijc D_ijc``; ``dD_ijc D_ijc = Y_ijc k_jc D_ijc`` flows to ``+G_i`` and ``-G_j``,
    whose sums over j and i are exactly ``q dq_i + k dk_i`` and ``k dk_j`` (no further pair tensor needed).
    """
    rows = torch.stack([d_qk, d_kk], -2)  # [NC, H, G, C_i, 2, C_j]
    dq_dk_rows = (rows @ c.k_decay).unbind(-2)  # contracts j: [NC, H, G, C_i, K] each
    d_q_row, d_k_row = dq_dk_rows
    y = d_kk.unsqueeze(-1) * c.k.unsqueeze(-2)  # [NC, H, G, C_i, C_j, K]
    y.addcmul_(d_qk.unsqueeze(-1), c.q.unsqueeze(-2))
    d_k_col = y.mul_(c.decay).sum(-3)  # contracts i: [NC, H, G, C_j, K]
    d_gamma = c.q * d_q_row + c.k * (d_k_row - d_k_col)
    d_q = d_q_row.sum(2, keepdim=True)
    d_k = (d_k_row + d_k_col).sum(2, keepdim=True)
    return d_q, d_k, d_gamma


def _chunk_end_state_grads(do_c: Tensor, c: _Chunks) -> Tensor:
    """Reverse loop: the gradient of the loss w.r.t. the state at the end of every chunk (zero after the last)."""
    # per chunk: dv_new = QK^T do + k_out dS';  dS = (q E)^T do - W^T dv_new + carry dS'
    d_v_new_local = (c.qk.transpose(-1, -2) @ do_c).flatten(1, 2)
    d_state_local = (c.qe.transpose(-1, -2) @ do_c).flatten(1, 2)
    w_t, k_out, carry = c.w.flatten(1, 2).transpose(-1, -2), c.k_out.flatten(1, 2), c.carry.flatten(1, 2)[..., None]
    d_states_end = torch.empty_like(d_state_local)
    d_states_end[-1].zero_()
    for i in range(c.n_chunks - 1, 0, -1):
        d_v_new = torch.baddbmm(d_v_new_local[i], k_out[i], d_states_end[i])
        torch.baddbmm(d_state_local[i], w_t[i], d_v_new, alpha=-1, out=d_states_end[i - 1])
        d_states_end[i - 1].addcmul_(carry[i], d_states_end[i])
    return d_states_end.view(c.n_chunks, c.H, c.G, *d_states_end.shape[2:])


# ---------------------------------------------------------------------------------------------------------------
# CUDA path: flash-linear-attention's own forward/backward functions. Read in fla-core 0.6.0 and 0.5.0; the
# arguments used are the ones both share (0.6 adds use_graph, state_v_first, ...; 0.5 has transpose_state_layout).
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
        # fla builds chunk indices with a host sync (0.6: repeat_interleave on device counts; 0.5: .tolist());
        # its tensor_cache keys them on the cu_seqlens object, so layers sharing one cu_seqlens tensor pay it
        # once per step. (0.6's sync-free use_graph mode, prepare_chunk_indices_static, has no 0.5 counterpart.)
        chunk_indices = fla.prepare_chunk_indices(cu_seqlens, FLA_CHUNK)
        o, _, g_cum, Aqk, Akk = fla.chunk_kda_fwd(
            q=q1, k=k1, v=v1, g=g1, beta=beta1, scale=scale, initial_state=None, output_final_state=False,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=FLA_CHUNK,
        )[:5]
    B, T = q.shape[:2]
    saved = [x.view(B, T, *x.shape[2:]) for x in norms] + [x.view(B, T, *x.shape[2:]) for x in (g_cum, Aqk, Akk)]
    return o.view(v.shape).to(q.dtype), saved


def _kernel_backward(do, q, k, v, g, beta, cu_seqlens, saved, use_qk_l2norm, scale):
    fla = backends.load(FLA_MODULE)
    v1, beta1, do1 = (_flat_row(x) for x in (v, beta, do))
    *norms, g_cum, Aqk, Akk = (_flat_row(x) for x in saved)
    q1, q_rstd, k1, k_rstd = norms if use_qk_l2norm else (_flat_row(q), None, _flat_row(k), None)
    with _device_guard(q):
        chunk_indices = fla.prepare_chunk_indices(cu_seqlens, FLA_CHUNK)
        dq, dk, dv, dbeta, dg = fla.chunk_kda_bwd(
            q=q1, k=k1, v=v1, beta=beta1, Aqk=Aqk, Akk=Akk, scale=scale, initial_state=None, do=do1, dht=None,
            g=g_cum, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=FLA_CHUNK,
        )[:5]
        if use_qk_l2norm:
            dq = fla.l2norm_bwd(q1, q_rstd, dq)
            dk = fla.l2norm_bwd(k1, k_rstd, dk)
    return tuple(
        d.reshape(x.shape).to(x.dtype).contiguous() for d, x in ((dq, q), (dk, k), (dv, v), (dg, g), (dbeta, beta))
    )
