"""What the chunked references share: the chunk layout, the per-chunk document masks, the l2norm helpers (the two
delta rules'), and the compute dtype (every op's). The delta rules' op declarations are in ``_delta_rule/``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..batch.derived import seq_idx_from_cu_seqlens

L2NORM_EPS = 1e-6  # transformers' l2norm and fla's l2norm_fwd use the same eps


def to_chunks(x_TD: Tensor, n_chunks: int, chunk: int) -> Tensor:
    """``[T, heads..., D]`` tokens (zero-padded to ``n_chunks * chunk``) -> ``[NC, heads..., C, D]`` contiguous."""
    pad = n_chunks * chunk - x_TD.shape[0]
    x_TD = F.pad(x_TD, (0, 0) * (x_TD.dim() - 1) + (0, pad))
    x = x_TD.reshape(n_chunks, chunk, *x_TD.shape[1:])
    return x.movedim(1, -2).contiguous()


def from_chunks(x: Tensor, total: int) -> Tensor:
    """Inverse of ``to_chunks``: ``[NC, heads..., C, D]`` -> ``[total, heads..., D]`` contiguous, no padding."""
    x = x.movedim(-2, 1)
    return x.reshape(-1, *x.shape[2:])[:total].contiguous()  # one chunk: reshape is a strided view


def l2norm(x: Tensor, enabled: bool) -> tuple[Tensor, Tensor | None]:
    """``x / sqrt(|x|^2 + eps)`` over the last dim, and the reciprocal norm (None when disabled)."""
    if not enabled:
        return x, None
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    return x * rstd, rstd


def l2norm_backward(dy: Tensor, y: Tensor, rstd: Tensor | None) -> Tensor:
    if rstd is None:
        return dy
    return rstd * (dy - (dy * y).sum(-1, keepdim=True) * y)


class ChunkedInputs:
    """A delta-rule op's inputs cut into chunks of ``chunk`` tokens, and every chunk's document masks: what both
    references' chunk-parallel parts start from.

    Tokens ``[B, T, heads, D]`` become ``[NC, H, G or 1, C, D]`` in the compute dtype (:meth:`chunked`; inverse
    :meth:`tokens`), with ``G = HV // H`` value heads per q/k head: ``q`` (normalised, then scaled) and ``k``
    ``[NC, H, 1, C, K]``, ``v`` ``[NC, H, G, C, V]``, ``beta`` ``[NC, H, G, C, 1]``. Per chunk: ``doc`` ``[NC, C]``
    each token's document id; ``same_doc`` ``[NC, C, C]`` the lower-triangular same-document mask (True on the
    diagonal); ``reads_state_NC`` whether a token continues the document of the token before its chunk (so it
    reads the carried state); ``in_last_doc_NC`` whether it belongs to the chunk's last document.
    """

    def __init__(self, q, k, v, beta, cu_seqlens, use_qk_l2norm, scale, chunk):
        H, K = q.shape[2:]
        self.total, self.H, self.G = q.shape[0] * q.shape[1], H, v.shape[2] // H
        self.n_chunks, self.chunk = -(-self.total // chunk), chunk
        self.dtype = compute_dtype(q)
        # normalised, unscaled q and k: the l2norm backward needs them
        self.q_unit, self.q_rstd = l2norm(q.reshape(self.total, H, K).to(self.dtype), use_qk_l2norm)
        self.k_unit, self.k_rstd = l2norm(k.reshape(self.total, H, K).to(self.dtype), use_qk_l2norm)
        self.q, self.k = self.chunked(self.q_unit * scale), self.chunked(self.k_unit)
        self.v, self.beta = self.chunked(v), self.chunked(beta[..., None])
        # padding tokens past cu_seqlens[-1] get their own document id, so they never touch real tokens
        doc = seq_idx_from_cu_seqlens(cu_seqlens, self.n_chunks * chunk).view(self.n_chunks, chunk)
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=doc.device).tril()
        previous = F.pad(doc[:-1, -1:], (0, 0, 1, 0), value=-1)  # the document of the token before each chunk
        self.doc, self.same_doc = doc, (doc[:, :, None] == doc[:, None, :]) & causal
        self.reads_state_NC, self.in_last_doc_NC = doc == previous, doc == doc[:, -1:]

    def chunked(self, x: Tensor) -> Tensor:
        """Tokens ``[B, T, H * (G or 1), D]`` (or ``[B*T, H, D]``) -> ``[NC, H, G or 1, C, D]`` in the compute dtype."""
        return to_chunks(x.reshape(self.total, self.H, -1, x.shape[-1]).to(self.dtype), self.n_chunks, self.chunk)

    def tokens(self, x: Tensor) -> Tensor:
        """``[NC, H, G, C, D]`` -> ``[B*T, H*G, D]``, the inverse of :meth:`chunked`."""
        return from_chunks(x.flatten(1, 2), self.total)

    def qk_grads(self, d_q: Tensor, d_k: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """The gradients of the op's q and k (``[B*T, H, K]``) from those of the chunked ``q`` and ``k``."""
        d_q = l2norm_backward(self.tokens(d_q) * scale, self.q_unit, self.q_rstd)
        return d_q, l2norm_backward(self.tokens(d_k), self.k_unit, self.k_rstd)


def _chunk_count(q: Tensor, chunk: int) -> int:
    return -(-q.shape[0] * q.shape[1] // chunk)


def fake_chunk_states_and_inverses(q: Tensor, v: Tensor, chunk: int) -> tuple[Tensor, list[Tensor]]:
    """What a delta-rule reference's forward returns: ``o`` in q's dtype, and, flat in the compute dtype, the state
    at every chunk start (``[NC, HV, K, V]``) and every chunk's ``A^-1`` (``[NC, HV, C, C]``)."""
    n_chunks, value_heads, dtype = _chunk_count(q, chunk), v.shape[2], compute_dtype(q)
    states = q.new_empty(n_chunks * value_heads * q.shape[3] * v.shape[3], dtype=dtype)
    inverses = q.new_empty(n_chunks * value_heads * chunk * chunk, dtype=dtype)
    return v.new_empty(v.shape, dtype=q.dtype), [states, inverses]


def saved_inverses(flat: Tensor, q: Tensor, v: Tensor, chunk: int) -> Tensor:
    """The forward's flat ``A^-1`` as ``[NC, H, G, C, C]``."""
    heads = q.shape[2]
    return flat.view(_chunk_count(q, chunk), heads, v.shape[2] // heads, chunk, chunk)


def unit_lower_inverse(pairs: Tensor) -> Tensor:
    """``A^-1`` for ``A = I + strict_lower(pairs)`` (``[..., C, C]``), the delta rules' UT matrix: one triangular
    solve for ``C`` columns. Where ``pairs`` is block-diagonal by document so is the inverse (forward substitution
    only ever adds exact zeros across documents), so products with it keep documents apart exactly."""
    eye = torch.eye(pairs.shape[-1], device=pairs.device, dtype=pairs.dtype)
    return torch.linalg.solve_triangular(pairs.tril(-1) + eye, eye, upper=False, unitriangular=True)


def segmented_cumsum(x: Tensor, same_doc: Tensor, tokens_dim: int = -1) -> Tensor:
    """Cumulative sum over a chunk's tokens that restarts at every document start:
    ``out_i = sum_{j <= i, same doc} x_j``.

    ``x`` is chunks first, ``[NC, ..., C]`` (``tokens_dim=-1``) or ``[NC, ..., C, K]`` (``tokens_dim=-2``, one sum
    per channel); ``same_doc`` is the ``[NC, C, C]`` lower-triangular same-document mask (True on the diagonal).
    A masked matrix product, not a difference of plain cumsums: other documents' terms enter only as exact
    zeros, so a document's sums do not depend on its neighbours' values, not even by rounding.
    """
    return _masked_sum(x, same_doc, tokens_dim)


def segmented_cumsum_backward(grad: Tensor, same_doc: Tensor, tokens_dim: int = -1) -> Tensor:
    """Gradient of :func:`segmented_cumsum`: the reverse cumulative sum, restarting at every document end."""
    return _masked_sum(grad, same_doc.transpose(-1, -2), tokens_dim)


def _masked_sum(x: Tensor, mask_NCC: Tensor, tokens_dim: int) -> Tensor:
    mask = mask_NCC.to(x.dtype)
    if tokens_dim == -1:
        # every row of a chunk at once: [NC, rows, C] @ mask^T, one matrix product per chunk. Broadcasting the mask
        # over the heads instead copies it per head and runs a matrix-vector product each: 8-10x slower on a
        # bench row (254 chunks, 8 value heads: 1.9 vs 0.2 ms), with bit-identical sums
        rows = x.reshape(x.shape[0], -1, x.shape[-1])
        return torch.bmm(rows, mask.transpose(-1, -2)).view(x.shape)
    ones = x.dim() - 3  # x's dims between the chunk dim and the token dim
    return mask.view(mask_NCC.shape[0], *(1,) * ones, *mask_NCC.shape[1:]) @ x


def compute_dtype(x: Tensor) -> torch.dtype:
    """What the references compute in: float32 at least (as transformers and the kernels accumulate); float64
    inputs stay float64, so fp64 gradchecks test the exact formulas."""
    return torch.promote_types(x.dtype, torch.float32)
