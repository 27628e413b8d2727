"""The gated delta rule's fast pure-torch path (any device, fp32 compute; fp64 stays fp64): masked chunks.

transformers' chunked algorithm with per-token document masks: cross-document pairs inside a chunk are masked out
of the UT system and the intra-chunk attention, and the state read, write and carry are masked at document starts.
Every in-chunk accumulation (the cumulative decay, its gradient) restarts at document starts, so a document's
results never depend on another document's values, not even by rounding. The chunk loop lives inside the op, so
the compiler never unrolls it (the stock function recompiles for every new length).

The backward is explicit: the forward saves the state at the start of every chunk and the inverse of every chunk's
UT matrix ``A`` (``[C, C]`` per chunk and value head: ``T * C`` numbers per head, what fla saves too); the backward
recomputes the other chunk-parallel quantities, runs one reverse loop over chunks for the state gradient (two small
matmuls per chunk, no autograd), and derives every input gradient with batched matmuls. With ``A^-1`` saved, no
triangular solve runs in the backward and the forward solves for ``C`` columns instead of ``K + V``: 25% less time
for the op's forward + backward on a bench row (8141 tokens, 52 documents, H=4, HV=8, K=V=32, 1 thread; 67 + 143 ms
against 75 + 175-211 ms with the two solves).

Layout inside: chunks first, ``[NC, H, G, C, D]`` with ``G = HV // H`` value heads per q/k head; q/k quantities
keep a size-1 G axis, so ``q k^T`` and ``k k^T`` are computed once per q/k head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._chunked import ChunkedInputs, segmented_cumsum, segmented_cumsum_backward, unit_lower_inverse
from .._delta_rule.reference import reference_paths

# The chunk: exact for any value. Its [C, C] pair tensors cost T * C per op and the backward's elementwise passes
# over them dominate a CPU step, while the sequential chunk loop costs T / C steps. Measured on a bench-like row
# (8158 tokens, 56 lognormal documents, H=4, HV=8, K=V=32, 2 threads): backward 128 ms at 32, 191 ms at 64,
# 109-145 ms at 16 (more loop steps); forward 48-53 ms at all three.
CHUNK = 32


class _Chunks(ChunkedInputs):
    """Everything chunk-parallel (no recurrence), computed once in the forward and recomputed in the backward.

    Per chunk, with gamma the in-chunk cumulative log decay of each token's own document and masks from the
    document id of each token: ``decay[i, j] = exp(gamma_i - gamma_j)`` for same-document ``j <= i`` (0 elsewhere);
    ``A = I + strict_lower(beta_i k_i.k_j decay[i, j])``; ``U = A^-1 (beta v)``; ``W = A^-1 (beta e k)`` with
    ``e_i = exp(gamma_i)`` where token i continues the document of the previous chunk (reads the state), else 0.
    The recurrence is then ``v_new = U - W S``; ``o = (q e) S + (q k^T * decay) v_new``;
    ``S' = carry * S + k_out^T v_new`` with ``k_out_j = k_j exp(gamma_C - gamma_j)`` for tokens j of the chunk's
    last document and ``carry = exp(gamma_C)`` when that document started before the chunk (else 0).
    """

    def __init__(self, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, a_inv: Tensor | None = None,
                 reads_initial: bool = False):
        super().__init__(q, k, v, beta, cu_seqlens, use_qk_l2norm, scale, CHUNK)
        if reads_initial:  # the first document continues a state given from outside: it reads it, as a carried state
            self.reads_state_NC[0] = self.doc[0] == self.doc[0, 0]
        self.beta = self.beta.squeeze(-1)  # [NC, H, G, C]
        self.reads_state = self.reads_state_NC[:, None, None, :]  # [NC, 1, 1, C]: broadcasts over H, G
        self.in_last_doc = self.in_last_doc_NC[:, None, None, :]
        self.gamma = segmented_cumsum(self.chunked(g[..., None]).squeeze(-1), self.same_doc)  # [NC, H, G, C]
        self._intra(a_inv)

    def _intra(self, a_inv: Tensor | None) -> None:
        gamma, gamma_last = self.gamma, self.gamma[..., -1:]
        pairwise = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~self.same_doc[:, None, None], -torch.inf)
        self.decay = pairwise.exp()  # [NC, H, G, C, C]
        self.e = gamma.exp() * self.reads_state  # [NC, H, G, C]
        # the last document's decay to the chunk end: a difference within that document's own cumulative sum
        self.out_decay = (gamma_last - gamma).masked_fill(~self.in_last_doc, -torch.inf).exp()
        self.carry = gamma_last.exp() * self.reads_state[..., -1:]  # [NC, H, G, 1]
        self.kk = self.k @ self.k.transpose(-1, -2)  # [NC, H, 1, C, C]
        self.qk = self.q @ self.k.transpose(-1, -2)
        # the backward gets A^-1 from the forward
        self.A_inv = unit_lower_inverse(self.beta[..., None] * self.kk * self.decay) if a_inv is None else a_inv
        self.bk = self.k * (self.beta * self.e)[..., None]  # [NC, H, G, C, K]
        rhs = torch.cat([self.v * self.beta[..., None], self.bk], -1)
        self.uw = self.A_inv @ rhs  # [U, W]: the backward's dA takes them together
        self.u, self.w = self.uw.split([self.v.shape[-1], self.k.shape[-1]], -1)
        self.qe = self.q * self.e[..., None]  # [NC, H, G, C, K]
        self.attn = self.qk * self.decay
        self.k_out = self.k * self.out_decay[..., None]


def _run(c: _Chunks, initial: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The chunked output ``[NC, H, G, C, V]`` and the state at every chunk start (from zero, or ``initial``; with
    ``initial``, then the final state too)."""
    states = _chunk_start_states(c.u, c.w, c.k_out, c.carry, initial)
    start = states if initial is None else states[:-1]
    return c.qe @ start + c.attn @ (c.u - c.w @ start), states


def _chunk_start_states(
    u: Tensor, w: Tensor, k_out: Tensor, carry: Tensor, initial: Tensor | None = None
) -> Tensor:
    """The recurrent state at the start of every chunk, ``[NC, H, G, K, V]`` (zero before the first chunk, or
    ``initial``); with ``initial`` given, also the state at the end of the last chunk, as one more entry."""
    chunks = u.shape[0] + (initial is not None)
    states = u.new_empty(chunks, *u.shape[1:3], w.shape[-1], u.shape[-1])
    if initial is None:
        states[0].zero_()
    else:
        states[0].copy_(initial)
    # value heads merged, [NC, H*G, ...], so each step is two fused batched products on views: the loop runs
    # T / C times and its per-op overhead, not its arithmetic, is what it costs
    s, u, w, k_out_t, carry = _heads_merged(states, u, w, k_out.transpose(-1, -2), carry[..., None])
    for i in range(chunks - 1):
        v_new = torch.baddbmm(u[i], w[i], s[i], alpha=-1)  # u - w @ s
        torch.baddbmm(s[i] * carry[i], k_out_t[i], v_new, out=s[i + 1])
    return states


def _heads_merged(*tensors: Tensor) -> list[Tensor]:
    """``[NC, H, G, ...]`` -> ``[NC, H*G, ...]``. A view for the contiguous states the loops create and write into
    (and for the split and transposed inputs: H and G stay adjacent in memory); a copy only for an input laid out
    otherwise, which the loops only read."""
    return [x.flatten(1, 2) for x in tensors]


def _backward(c: _Chunks, states: Tensor, do: Tensor, scale: float, d_final: Tensor | None = None):
    """The gradients of q, k, v, g, beta (token layout) and of the state at the start of the first chunk, given
    ``states`` (at every chunk start) and ``d_final``, the gradient of the state at the end of the last chunk."""
    do_c = c.chunked(do)  # [NC, H, G, C, V]
    v_new = c.u - c.w @ states
    d_states_end = _chunk_end_state_grads(do_c, c, d_final)  # dL/dS' for every chunk
    d_v_new = c.attn.transpose(-1, -2) @ do_c + c.k_out @ d_states_end
    d_w = -(d_v_new @ states.transpose(-1, -2))
    d_qe = do_c @ states.transpose(-1, -2)
    d_attn = do_c @ v_new.transpose(-1, -2)
    d_k_out = v_new @ d_states_end.transpose(-1, -2)
    d_carry = (states * d_states_end).sum((-2, -1))[..., None]  # [NC, H, G, 1]

    # through U, W = A^-1 [beta v, beta e k]: d rhs = A^-T [dU, dW]; dA = -(d rhs) [U, W]^T on the strict lower part
    d_rhs = c.A_inv.transpose(-1, -2) @ torch.cat([d_v_new, d_w], -1)
    d_bv, d_bk = d_rhs.split([c.v.shape[-1], c.k.shape[-1]], -1)

    # A = beta_i kk_ij decay_ij (strict lower), attn = qk_ij decay_ij
    # each [C, C] product is formed once and reused: on CPU these elementwise passes dominate the backward. Only
    # dA * decay is ever used, so it is formed in place, sign kept: decay is 0 above the diagonal, so zeroing the
    # diagonal leaves the strict lower part, and the minus sign goes to the per-token factors instead of a pass
    minus_d_A_decay = (d_rhs @ c.uw.transpose(-1, -2)).mul_(c.decay)
    minus_d_A_decay.diagonal(dim1=-2, dim2=-1).zero_()
    d_attn_decay = d_attn * c.decay
    d_beta = (d_bv * c.v).sum(-1) + (d_bk * c.k).sum(-1) * c.e - (minus_d_A_decay * c.kk).sum(-1)
    d_kk_pairs = minus_d_A_decay * c.beta.neg()[..., None]
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
    d_g = segmented_cumsum_backward(d_gamma, c.same_doc)  # gamma is a per-document cumsum of g within the chunk

    d_initial = None
    if d_final is not None:  # the state the first chunk starts from: read by (q e) and W, carried into its end
        d_initial = c.qe[0].transpose(-1, -2) @ do_c[0] - c.w[0].transpose(-1, -2) @ d_v_new[0]
        d_initial += c.carry[0][..., None] * d_states_end[0]

    d_q, d_k = c.qk_grads(d_q, d_k, scale)
    return (d_q, d_k, c.tokens(d_v), c.tokens(d_g[..., None]), c.tokens(d_beta[..., None])), d_initial


def _chunk_end_state_grads(do_c: Tensor, c: _Chunks, d_final: Tensor | None = None) -> Tensor:
    """Reverse loop: the gradient of the loss w.r.t. the state at the end of every chunk (zero after the last, or
    ``d_final``, that of the final state)."""
    # per chunk: dv_new = attn^T do + k_out dS';  dS = (q e)^T do - W^T dv_new + carry dS'
    d_v_new_local = c.attn.transpose(-1, -2) @ do_c
    d_state_local = c.qe.transpose(-1, -2) @ do_c
    d_states_end = torch.empty_like(d_state_local)
    if d_final is None:
        d_states_end[-1].zero_()
    else:
        d_states_end[-1].copy_(d_final)
    d_end, d_v_local, d_s_local, k_out, w_t, carry = _heads_merged(
        d_states_end, d_v_new_local, d_state_local, c.k_out, c.w.transpose(-1, -2), c.carry[..., None])
    for i in range(c.n_chunks - 1, 0, -1):
        d_v_new = torch.baddbmm(d_v_local[i], k_out[i], d_end[i])
        torch.baddbmm(torch.addcmul(d_s_local[i], carry[i], d_end[i]), w_t[i], d_v_new, alpha=-1, out=d_end[i - 1])
    return d_states_end


# ``compilepack::gated_delta_rule_varlen`` and ``..._state`` (context parallelism over tokens): the delta rules'
# shared paths (``_delta_rule/reference.py``) with this rule's chunks, run and backward.
PATH, PATH_STATE = reference_paths(_Chunks, _run, _backward, CHUNK)
