"""Kimi delta attention's fast pure-torch path (any device, fp32 compute; fp64 stays fp64): masked chunks, each
cut into sub-chunks for the per-channel pair decays.

KDA decays every key channel on its own, so the decay between tokens i >= j of a chunk, ``exp(G_i - G_j)`` (``G``
the in-chunk cumulative log decay), is a K-vector per pair, and ``QK_ij = sum_c q_ic k_jc exp(G_ic - G_jc)`` (and
``KK``) is not one matmul of ``q e^G`` by ``k e^-G``: ``e^-G`` overflows fp32 once a channel decays by more than
~88 nats inside a chunk. As in fla's kernels, a chunk is cut into sub-chunks of ``SUB`` tokens:

- pairs inside one sub-chunk are formed elementwise, over ``[SUB, SUB, K]``;
- pairs with ``j`` in an earlier sub-chunk than ``i`` go through two sub-chunk ends between them, ``r`` the last
  token before ``i``'s sub-chunk and ``e`` the last of ``j``'s: ``exp(G_i - G_r) exp(G_r - G_e) exp(G_e - G_j)``,
  three factors <= 1 (decays are <= 0), so these pairs are matmuls that cannot overflow.

Documents: ``G`` restarts at every document start (a segmented cumsum) and every mask is applied to an exponent
(-inf) before any sum, so a factor whose tokens lie in two documents is an exact zero and a document's results
never depend on another document's values, not even by rounding. The state read, write and carry between chunks
are masked at document starts.

The state recurrence is a loop over chunks inside the op (the compiler never unrolls it). Its steps are a few
small matmuls whose cost is mostly per call (each may hand work to the other intra-op threads, which costs
milliseconds when the cores are shared), so the chunk is long (``CHUNK`` tokens: few steps) while the
elementwise pair tensors stay sub-chunk sized.

The backward is explicit: the forward saves the state at the start of every chunk and the inverse of every chunk's
UT matrix ``A`` (``T * C`` numbers per value head, as in the gated delta rule); the backward recomputes the other
chunk-parallel quantities, runs one reverse loop over chunks for the state gradient, and derives every input
gradient with batched products, no autograd. With ``A^-1`` saved no triangular solve runs in the backward, and the
forward's solves for ``C`` columns instead of ``K + V``.

Layout inside: chunks first, ``[NC, H, G, C, D]`` with ``G = HV // H`` value heads per q/k head (q and k keep a
size-1 G axis); sub-chunk tensors split ``C`` into ``[M, SUB]`` (``M = CHUNK // SUB``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._chunked import ChunkedInputs, segmented_cumsum, segmented_cumsum_backward, unit_lower_inverse
from .._delta_rule.reference import reference_paths

# Chunk and sub-chunk (exact for any values). Per head and token, the sub-chunk pair tensors cost SUB * K, the
# links across sub-chunks (CHUNK / SUB) * K; the state loop runs T / CHUNK steps of three small calls. Measured on
# the op benchmark's row (2048 tokens, 16 documents, 4 heads; fwd+bwd; 1 thread, CPU time, variants interleaved):
# 32/4: 165 ms at K = V = 64, 355 ms at 128; 32/8: 175/475; 64/8: 215/475; 64/4: 245/475; 32/2: 225/465. On 2
# threads 32/4 takes 87 ms at 64, the former single-level chunk of 8 (256 loop steps, not 64) 104-111 ms.
CHUNK = 32
SUB = 4
M = CHUNK // SUB  # sub-chunks per chunk


def _exp_where(keep: Tensor, exponent: Tensor) -> Tensor:
    """``exp(exponent)`` where ``keep``, an exact 0 elsewhere (masked before the exponential: no inf * 0)."""
    return exponent.masked_fill(~keep, -torch.inf).exp_()


def _blocks(x: Tensor, dim: int = -2) -> Tensor:
    """Split a chunk's token dim into ``[M, SUB]`` (a view)."""
    return x.unflatten(dim, (M, SUB))


def _diagonal_blocks(pairs: Tensor) -> Tensor:
    """The ``[..., M, SUB, SUB]`` sub-chunk blocks on the diagonal of ``[..., C, C]`` pair tensors (a view)."""
    return _blocks(_blocks(pairs, -1), -3).diagonal(0, -4, -2).movedim(-1, -3)


class _Chunks(ChunkedInputs):
    """Everything chunk-parallel (no recurrence), computed once in the forward and recomputed in the backward.

    With masks from each token's document: ``D[i, j, c] = exp(G_ic - G_jc)`` for same-document ``j <= i`` (0
    elsewhere); ``QK[i, j] = sum_c q_ic k_jc D_ijc``, ``KK`` likewise; ``A = I + strict_lower(beta_i KK_ij)``;
    ``U = A^-1 (beta v)``; ``W = A^-1 (beta k E)`` with ``E_i = exp(G_i)`` where token i continues the document
    of the previous chunk (reads the state), else 0. The recurrence is then ``v_new = U - W S``;
    ``o = (q E) S + QK v_new``; ``S' = carry * S + (k O)^T v_new`` with ``O_j = exp(G_C - G_j)`` for tokens j of
    the chunk's last document (else 0) and the per-channel ``carry = exp(G_C)`` when that document started before
    the chunk (else 0).

    ``QK`` and ``KK`` by sub-chunks: elementwise inside one (``block_decay`` is D there); for j in sub-chunk
    a < b (that of i), ``D_ijc = row_i * link_ba * col_j`` with ``row_i = exp(G_i - G_e(b-1))``,
    ``link_ba = exp(G_e(b-1) - G_e(a))`` and ``col_j = exp(G_e(a) - G_j)``, ``e(a)`` the last token of sub-chunk
    a: three factors <= 1, each an exact 0 unless its two tokens share a document.
    """

    def __init__(self, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, a_inv: Tensor | None = None,
                 reads_initial: bool = False):
        super().__init__(q, k, v, beta, cu_seqlens, use_qk_l2norm, scale, CHUNK)  # q, k, v, beta: [NC, H, G, C, D]
        if reads_initial:  # the first document continues a state given from outside: it reads it, as a carried state
            self.reads_state_NC[0] = self.doc[0] == self.doc[0, 0]
        self.g = self.chunked(g)  # [NC, H, G, C, K]
        self._masks()
        self.gamma = segmented_cumsum(self.g, self.same_doc, tokens_dim=-2)  # restarts at document starts
        self._decays()
        self._pairs()
        self._solve(a_inv)

    def _masks(self) -> None:
        doc = self.doc
        per_token = lambda mask: mask[:, None, None, :, None]  # noqa: E731  [NC, C] -> [NC, 1, 1, C, 1]
        self.reads_state, self.in_last_doc = per_token(self.reads_state_NC), per_token(self.in_last_doc_NC)
        # pairs across sub-chunks go through sub-chunk ends: each factor needs its two tokens in one document
        end_doc = doc[:, SUB - 1 :: SUB]  # [NC, M]: the document of each sub-chunk's last token
        ref_doc = F.pad(end_doc[:, :-1], (1, 0), value=-1)  # that of the end before sub-chunk b (none for b = 0)
        self.row_ok = per_token((_blocks(doc, -1) == ref_doc[..., None]).flatten(-2))  # i ~ the end before it
        self.col_ok = per_token((_blocks(doc, -1) == end_doc[..., None]).flatten(-2))  # j ~ its sub-chunk's end
        earlier = torch.ones(M, M, dtype=torch.bool, device=doc.device).tril(-1)  # [b, a]: a before b
        self.link_ok = ((ref_doc[:, :, None] == end_doc[:, None, :]) & earlier)[:, None, None, ..., None]
        self.block_same_doc = _diagonal_blocks(self.same_doc)[:, None, None, ..., None]  # [NC, 1, 1, M, SUB, SUB, 1]

    def _decays(self) -> None:
        gamma = self.gamma
        self.e = _exp_where(self.reads_state, gamma)  # [NC, H, G, C, K]
        self.carry = self.e[..., -1:, :]  # exp(G_C) if the last token reads the state: [NC, H, G, 1, K]
        # the last document's decay to the chunk end: a difference within that document's own cumulative sum
        self.out_decay = _exp_where(self.in_last_doc, gamma[..., -1:, :] - gamma)
        sub = _blocks(gamma)  # [NC, H, G, M, SUB, K]
        ends = sub[..., -1, :]  # G at the last token of each sub-chunk: [NC, H, G, M, K]
        ref = F.pad(ends[..., :-1, :], (0, 0, 1, 0))  # G at the end before each sub-chunk (0 for the first)
        self.row_decay = _exp_where(self.row_ok, (sub - ref[..., None, :]).flatten(-3, -2))  # [NC, H, G, C, K]
        self.col_decay = _exp_where(self.col_ok, (ends[..., None, :] - sub).flatten(-3, -2))
        self.link_decay = _exp_where(self.link_ok, ref[..., None, :] - ends[..., None, :, :])  # [.., M_b, M_a, K]
        # inside a sub-chunk: D_ijc elementwise, [NC, H, G, M, SUB_i, SUB_j, K] (in place: the largest tensor)
        pairwise = sub.unsqueeze(-2) - sub.unsqueeze(-3)
        self.block_decay = pairwise.masked_fill_(~self.block_same_doc, -torch.inf).exp_()

    def _pairs(self) -> None:
        """QK and KK ``[NC, H, G, C, C]``: sub-chunk diagonal blocks elementwise, the rest as matmuls."""
        q_sub, k_sub = _blocks(self.q), _blocks(self.k)  # [NC, H, 1, M, SUB, K]
        self.k_decay = self.block_decay * k_sub.unsqueeze(-3)  # k_j D_ijc
        qk_block, kk_block = (self.k_decay @ torch.stack([q_sub, k_sub], -1)).unbind(-1)  # [.., M, SUB_i, SUB_j]
        # rows: (q_i, k_i) exp(G_i - G_end(b-1)) per sub-chunk b; columns, for each b: k_j times the rest
        self.rows = torch.cat([_blocks(self.q * self.row_decay), _blocks(self.k * self.row_decay)], -2)
        k_end = _blocks(self.k * self.col_decay)  # [NC, H, G, M_a, SUB, K]
        self.k_col = (k_end.unsqueeze(-4) * self.link_decay.unsqueeze(-2)).flatten(-3, -2)  # [.., M_b, C, K]
        across = self.rows @ self.k_col.transpose(-1, -2)  # [NC, H, G, M, 2 SUB, C]
        self.qk, self.kk = (x.flatten(-3, -2) for x in across.split(SUB, -2))  # copies: [NC, H, G, C, C]
        _diagonal_blocks(self.qk).add_(qk_block)  # the diagonal blocks are exact zeros in ``across``
        _diagonal_blocks(self.kk).add_(kk_block)

    def _solve(self, a_inv: Tensor | None) -> None:
        # the backward gets A^-1 from the forward
        self.A_inv = unit_lower_inverse(self.beta * self.kk) if a_inv is None else a_inv  # [NC, H, G, C, C]
        self.ke = self.k * self.e  # [NC, H, G, C, K]
        self.bke = self.ke * self.beta
        rhs = torch.cat([self.v * self.beta, self.bke], -1)
        uw = self.A_inv @ rhs
        self.u, self.w = uw.split([self.v.shape[-1], self.k.shape[-1]], -1)
        self.qe = self.q * self.e
        self.k_out = self.k * self.out_decay


def _run(c: _Chunks, initial: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The chunked output ``[NC, H, G, C, V]`` and the state at every chunk start (from zero, or ``initial``; with
    ``initial``, then the final state too)."""
    states, v_new = _chunk_start_states(c, initial)
    start = states if initial is None else states[:-1]
    return c.qe @ start + c.qk @ v_new, states


def _chunk_start_states(c: _Chunks, initial: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The state at the start of every chunk ``[NC, H, G, K, V]`` (zero before the first, or ``initial``) and
    ``v_new = U - W S``; with ``initial`` given, also the state at the end of the last chunk, as one more entry."""
    # 3-D per-chunk operands, so every step is one bmm-family call (the loop is per-call overhead bound)
    u, w = c.u.flatten(1, 2), c.w.flatten(1, 2)
    k_out_t = c.k_out.flatten(1, 2).transpose(-1, -2).contiguous()  # [NC, HG, K, C]
    carry = c.carry.flatten(1, 2).transpose(-1, -2)  # [NC, HG, K, 1]
    chunks = c.n_chunks + (initial is not None)
    states = u.new_empty(chunks, u.shape[1], w.shape[-1], u.shape[-1])
    if initial is None:
        states[0].zero_()
    else:
        states[0].copy_(initial.flatten(0, 1))
    v_new = torch.empty_like(u)
    for i in range(c.n_chunks):
        torch.baddbmm(u[i], w[i], states[i], alpha=-1, out=v_new[i])
        if i + 1 < chunks:
            torch.bmm(k_out_t[i], v_new[i], out=states[i + 1]).addcmul_(carry[i], states[i])
    return states.view(chunks, *c.u.shape[1:3], *states.shape[2:]), v_new.view(c.u.shape)


def _backward(c: _Chunks, states: Tensor, do: Tensor, scale: float, d_final: Tensor | None = None):
    """The gradients of q, k, v, g, beta (token layout) and, with ``d_final`` (the gradient of the state at the end
    of the last chunk), of the state at the start of the first chunk; ``states``: at every chunk start."""
    do_c = c.chunked(do)  # [NC, H, G, C, V]
    v_new = c.u - c.w @ states
    # per chunk: dv_new = QK^T do + (k O) dS';  dS = (q E)^T do - W^T dv_new + carry dS'
    d_v_new = c.qk.transpose(-1, -2) @ do_c
    d_state_local = c.qe.transpose(-1, -2) @ do_c
    d_states_end = _chunk_end_state_grads(d_v_new, d_state_local, c, d_final)  # dL/dS' for every chunk
    d_v_new += c.k_out @ d_states_end
    d_w = -(d_v_new @ states.transpose(-1, -2))
    d_qe = do_c @ states.transpose(-1, -2)  # [NC, H, G, C, K]
    d_qk = do_c @ v_new.transpose(-1, -2)  # [NC, H, G, C, C]
    d_k_out = v_new @ d_states_end.transpose(-1, -2)
    d_carry = (states * d_states_end).sum(-1)[..., None, :]  # diagonal of S dS'^T: [NC, H, G, 1, K]

    # through U, W = A^-1 [beta v, beta k E]: d rhs = A^-T [dU, dW]; dA = -(d rhs) [U, W]^T on the strict lower part
    d_rhs = c.A_inv.transpose(-1, -2) @ torch.cat([d_v_new, d_w], -1)
    d_bv, d_bke = d_rhs.split([c.v.shape[-1], c.k.shape[-1]], -1)
    d_A = -(d_bv @ c.u.transpose(-1, -2) + d_bke @ c.w.transpose(-1, -2)).tril(-1)
    d_beta = ((d_A * c.kk).sum(-1) + (d_bv * c.v).sum(-1) + (d_bke * c.ke).sum(-1))[..., None]  # [NC, H, G, C, 1]

    d_q, d_k_row, d_k_col = _pair_grads(c, d_qk, d_A * c.beta)
    # D_ijc = exp(G_ic - G_jc): the row role gives +G_i, the column role -G_j (see _pair_grads)
    d_gamma = c.q * d_q + c.k * (d_k_row - d_k_col)
    # E: q E (state read in o) and beta k E (state read in the UT system); O: the state write; carry
    d_q = d_q + d_qe * c.e
    d_k = d_k_row + d_k_col + d_bke * c.e * c.beta + d_k_out * c.out_decay
    d_k_out_x_k_out = d_k_out * c.k_out
    d_gamma += d_qe * c.qe + d_bke * c.bke - d_k_out_x_k_out
    d_gamma[..., -1:, :] += d_k_out_x_k_out.sum(-2, keepdim=True) + d_carry * c.carry
    d_g = segmented_cumsum_backward(d_gamma, c.same_doc, tokens_dim=-2)  # G is a per-document cumsum of g

    d_initial = None
    if d_final is not None:  # the state the first chunk starts from: read by (q E) and W, carried into its end
        d_initial = d_state_local[0] - c.w[0].transpose(-1, -2) @ d_v_new[0]
        d_initial += c.carry[0].transpose(-1, -2) * d_states_end[0]

    d_q, d_k = c.qk_grads(d_q.sum(2, keepdim=True), d_k.sum(2, keepdim=True), scale)
    return (d_q, d_k, c.tokens(d_bv * c.beta), c.tokens(d_g), c.tokens(d_beta)), d_initial


def _pair_grads(c: _Chunks, d_qk: Tensor, d_kk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients through ``QK_ij = sum_c q_ic k_jc D_ijc`` and ``KK_ij = sum_c k_ic k_jc D_ijc``, ``[NC, H, G, C, K]``:
    dq and dk in the row role (``i``) and dk in the column role (``j``), per value head (not summed over G).

    The G gradient follows from these: ``dD_ijc D_ijc`` flows to ``+G_i`` and ``-G_j``, and its sums over j and
    over i are ``q dq_row + k dk_row`` and ``k dk_col``; the sub-chunk references cancel out of it.
    """
    # across sub-chunks: rows (q, k) exp(G_i - G_r) against columns k_j exp(G_r - G_e) exp(G_e - G_j)
    d_rows = torch.cat([_blocks(d_qk), _blocks(d_kk)], -2)  # [NC, H, G, M, 2 SUB, C]
    d_q, d_k_row = (x.flatten(-3, -2) * c.row_decay for x in (d_rows @ c.k_col).split(SUB, -2))
    d_k_col_x = _blocks(d_rows.transpose(-1, -2) @ c.rows).mul_(c.link_decay.unsqueeze(-2))  # [.., M_b, M_a, SUB, K]
    d_k_col = d_k_col_x.sum(-4).flatten(-3, -2) * c.col_decay
    # inside sub-chunks (the diagonal blocks): elementwise, as they were formed
    d_qk_block, d_kk_block = _diagonal_blocks(d_qk), _diagonal_blocks(d_kk)  # [NC, H, G, M, SUB_i, SUB_j]
    d_rows_block = torch.stack([d_qk_block, d_kk_block], -2) @ c.k_decay  # contracts j: [.., M, SUB_i, 2, K]
    _blocks(d_q).add_(d_rows_block[..., 0, :])
    _blocks(d_k_row).add_(d_rows_block[..., 1, :])
    y = d_kk_block.unsqueeze(-1) * _blocks(c.k).unsqueeze(-2)  # [NC, H, G, M, SUB_i, SUB_j, K]
    y.addcmul_(d_qk_block.unsqueeze(-1), _blocks(c.q).unsqueeze(-2))
    _blocks(d_k_col).add_(y.mul_(c.block_decay).sum(-3))  # contracts i
    return d_q, d_k_row, d_k_col


def _chunk_end_state_grads(d_v_new_local: Tensor, d_state_local: Tensor, c: _Chunks, d_final: Tensor | None = None
                           ) -> Tensor:
    """Reverse loop: the gradient of the loss w.r.t. the state at the end of every chunk (zero after the last, or
    ``d_final``, that of the final state)."""
    d_v_new_local, d_state_local = d_v_new_local.flatten(1, 2), d_state_local.flatten(1, 2)
    w_t = c.w.flatten(1, 2).transpose(-1, -2).contiguous()  # [NC, HG, K, C]
    k_out, carry = c.k_out.flatten(1, 2), c.carry.flatten(1, 2).transpose(-1, -2)
    d_states_end = torch.empty_like(d_state_local)
    if d_final is None:
        d_states_end[-1].zero_()
    else:
        d_states_end[-1].copy_(d_final.flatten(0, 1))
    for i in range(c.n_chunks - 1, 0, -1):
        d_v_new = torch.baddbmm(d_v_new_local[i], k_out[i], d_states_end[i])
        torch.baddbmm(d_state_local[i], w_t[i], d_v_new, alpha=-1, out=d_states_end[i - 1])
        d_states_end[i - 1].addcmul_(carry[i], d_states_end[i])
    return d_states_end.view(c.n_chunks, c.H, c.G, *d_states_end.shape[2:])


# ``compilepack::kimi_delta_attention_varlen`` and ``..._state``: the delta rules' shared paths
# (``_delta_rule/reference.py``); with a state, each row's first document starts from ``initial_state[row]``, each
# row's last state is returned; rows run one at a time, their chunk padding joining their last document.
PATH, PATH_STATE = reference_paths(_Chunks, _run, _backward, CHUNK)
