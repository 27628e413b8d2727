"""Varlen attention's pure-torch path (any device): one attention call per document, explicit backward.

Each document is attended on its own slice of q, k, v, so a document's output and gradients are computed from its
own tokens only (isolation is exact by construction). On CPU each document goes through the CPU flash-attention
kernel (tiled: the ``L x L`` scores are never materialised, and it returns the log-sum-exp the backward needs),
which takes grouped key/value heads (GQA) as they are and sums the shared heads' gradients itself: no repeated
copies of k and v (a bench row, 8141 tokens, 52 documents, 8 query / 2 kv heads, 1 thread: forward+backward 180 ms
against 196 ms with the copies). Elsewhere through explicit math, which repeats k and v to the query heads. Both
compute in ``compute_dtype(q)`` (float32, or float64 for float64 inputs, so fp64 gradchecks test the exact
formulas); the saved log-sum-exp is in that dtype too.

The document loop needs the boundaries as Python ints: they are read from ``cu_seqlens_cpu`` when the caller has the
host copy, so a CUDA ``cu_seqlens`` is never copied back to the host; otherwise from ``cu_seqlens`` (free on CPU).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._chunked import compute_dtype
from ...batch.rules import refuse_steps_back
from .._scaffold import Path

# ``window_left`` when there is no sliding window: flash-attn's and torch's "unbounded" (-1), passed through as is
NO_WINDOW = -1


def forward(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale, window_left):
    dtype = compute_dtype(q)
    total, heads = q.shape[:2]
    out = q.new_zeros(total, heads, v.shape[2])
    lse = q.new_zeros(heads, total, dtype=dtype)
    for start, end in _documents(cu_seqlens, cu_seqlens_cpu, total):
        q_d, k_d, v_d = (_heads_first(x, start, end, dtype) for x in (q, k, v))
        mask = _window_mask(end - start, causal, window_left, q.device)
        out_d, lse_d = _document_forward(q_d, k_d, v_d, causal, scale, mask)
        out[start:end] = out_d[0].transpose(0, 1)
        lse[:, start:end] = lse_d[0]
    return out, [lse]


def fake(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale, window_left):
    total, heads = q.shape[:2]
    return q.new_empty(total, heads, v.shape[2]), [q.new_empty(heads, total, dtype=compute_dtype(q))]


def backward(grad_out, out, saved, needs_grad, q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale,
             window_left):
    (lse,) = saved
    dtype = lse.dtype
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start, end in _documents(cu_seqlens, cu_seqlens_cpu, q.shape[0]):
        q_d, k_d, v_d, out_d, grad_d = (_heads_first(x, start, end, dtype) for x in (q, k, v, out, grad_out))
        mask = _window_mask(end - start, causal, window_left, q.device)
        dq_d, dk_d, dv_d = _document_backward(grad_d, q_d, k_d, v_d, out_d, lse[None, :, start:end], causal, scale,
                                              mask)
        dq[start:end] = dq_d[0].transpose(0, 1)
        dk[start:end] = dk_d[0].transpose(0, 1)  # the kv heads' gradients: summed over the query heads sharing them
        dv[start:end] = dv_d[0].transpose(0, 1)
    return dq, dk, dv


def host_boundaries(cu_seqlens: Tensor) -> list[int]:
    """``cu_seqlens`` as Python ints, for the loop over documents. Only called inside the op's body, which the
    compiler treats as opaque: the conversion never becomes a graph break. On CPU it is free; a CUDA reference call
    pays one sync here."""
    return cu_seqlens.tolist()


def _documents(cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None, total: int, keep_empty: bool = False
               ) -> list[tuple[int, int]]:
    """(start, end) of every non-empty document (every document with ``keep_empty``); refuses boundaries that do
    not cover the tokens exactly."""
    argument, boundaries = ("cu_seqlens", cu_seqlens) if cu_seqlens_cpu is None else ("cu_seqlens_cpu", cu_seqlens_cpu)
    host = boundaries.cpu()  # itself on the host; on a CUDA reference call, the one copy this loop pays anyway
    # the op's up-front check skipped boundaries off the host: a CUDA reference call without the host copy is
    # checked here (on the host it repeats that check, a compare of N+1 ints)
    refuse_steps_back("varlen_attention", argument, host)
    bounds = host_boundaries(host)
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"varlen_attention: cu_seqlens must start at 0 and end at the token count {total}; "
            f"got {bounds[0]} ... {bounds[-1]}. Tokens outside the documents would be dropped."
        )
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s or keep_empty]


def _heads_first(x: Tensor, start: int, end: int, dtype: torch.dtype) -> Tensor:
    """Document slice of ``[T, h, d]`` as ``[1, h, L, d]`` in ``dtype`` (a strided view when the dtype matches)."""
    return x[start:end].transpose(0, 1).to(dtype).unsqueeze(0)


def _repeat_kv(x: Tensor, heads: int) -> Tensor:
    """``[1, kv_heads, L, d]`` with each head repeated for the ``heads`` query heads that share it (GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _window_mask(length: int, causal: bool, window_left: int, device) -> Tensor | None:
    """Boolean ``[L, L]`` mask (True = attend) when a window applies; None when plain causal/full suffices."""
    if window_left == NO_WINDOW:
        return None
    idx = torch.arange(length, device=device)
    distance = idx[:, None] - idx[None, :]
    allowed = distance <= window_left
    if causal:
        allowed &= distance >= 0
    else:
        allowed &= distance >= -window_left
    return allowed


def _document_forward(q, k, v, causal, scale, mask):
    """One document, ``[1, H, L, D]``: output and log-sum-exp ``[1, H, L]``, in q's dtype."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and mask is None, attn_mask=_additive(mask, q.dtype), scale=scale
        )
    return _math_forward(q, k, v, causal, scale, mask)


def _document_backward(grad_out, q, k, v, out, lse, causal, scale, mask):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal and mask is None, attn_mask=_additive(mask, q.dtype), scale=scale
        )
    return _math_backward(grad_out, q, k, v, out, lse, causal, scale, mask)


def _math_forward(q, k, v, causal, scale, mask):
    """Off CPU: the masked scores in full (``[H, L, L]`` per document)."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    scores = _masked_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _math_backward(grad_out, q, k, v, out, lse, causal, scale, mask):
    kv_heads, heads = k.shape[1], q.shape[1]
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    probs = torch.exp(_masked_scores(q, k, causal, scale, mask) - lse.unsqueeze(-1))
    grad_v = probs.transpose(-1, -2) @ grad_out
    grad_probs = grad_out @ v.transpose(-1, -2)
    delta = (grad_out * out).sum(-1, keepdim=True)  # = sum_j P_ij dP_ij: the softmax backward's row term
    grad_scores = probs * (grad_probs - delta) * scale
    grad_k = grad_scores.transpose(-1, -2) @ q
    return grad_scores @ k, _sum_shared(grad_k, kv_heads), _sum_shared(grad_v, kv_heads)


def _sum_shared(grad: Tensor, kv_heads: int) -> Tensor:
    """GQA: a key/value head's gradient is the sum over the query heads that shared it."""
    batch, heads, length, dim = grad.shape
    return grad.view(batch, kv_heads, heads // kv_heads, length, dim).sum(2)


def _additive(mask: Tensor | None, dtype) -> Tensor | None:
    """The CPU flash kernel takes a float mask of the query dtype: 0 where allowed, -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def _masked_scores(q, k, causal, scale, mask):
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is None and causal:
        length = q.shape[-2]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return scores


PATH = Path(forward=forward, backward=backward, fake=fake)


# ------------------------------------------------------------------------------------------------ keys beyond queries
#
# ``compilepack::varlen_attention_kv`` (context parallelism over tokens): document ``i``'s queries are tokens
# ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q and its keys tokens ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` of k and v,
# the queries being the last ones of the document so far (flash-attn's varlen convention with ``causal``: the causal
# mask is aligned at the bottom right). A rank holding a slice of a document attends its queries to all the keys of
# the document up to its slice end.


def forward_kv(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k,
               causal, scale, window_left):
    dtype = compute_dtype(q)
    total, heads = q.shape[:2]
    out = q.new_zeros(total, heads, v.shape[2])
    lse = q.new_zeros(heads, total, dtype=dtype)
    for (q_start, q_end), (k_start, k_end) in _document_pairs(cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k,
                                                              cu_seqlens_k_cpu, total, k.shape[0]):
        q_d = _heads_first(q, q_start, q_end, dtype)
        k_d, v_d = (_heads_first(x, k_start, k_end, dtype) for x in (k, v))
        mask = _suffix_mask(q_end - q_start, k_end - k_start, causal, window_left, q.device)
        out_d, lse_d = _document_forward(q_d, k_d, v_d, causal, scale, mask)
        out[q_start:q_end] = out_d[0].transpose(0, 1)
        lse[:, q_start:q_end] = lse_d[0]
    return out, [lse]


def fake_kv(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k,
            causal, scale, window_left):
    return fake(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, max_seqlen_q, causal, scale, window_left)


def backward_kv(grad_out, out, saved, needs_grad, q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k,
                cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k, causal, scale, window_left):
    (lse,) = saved
    dtype = lse.dtype
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q_start, q_end), (k_start, k_end) in _document_pairs(cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k,
                                                              cu_seqlens_k_cpu, q.shape[0], k.shape[0]):
        q_d, out_d, grad_d = (_heads_first(x, q_start, q_end, dtype) for x in (q, out, grad_out))
        k_d, v_d = (_heads_first(x, k_start, k_end, dtype) for x in (k, v))
        mask = _suffix_mask(q_end - q_start, k_end - k_start, causal, window_left, q.device)
        dq_d, dk_d, dv_d = _document_backward(grad_d, q_d, k_d, v_d, out_d, lse[None, :, q_start:q_end], causal,
                                              scale, mask)
        dq[q_start:q_end] = dq_d[0].transpose(0, 1)
        dk[k_start:k_end] = dk_d[0].transpose(0, 1)
        dv[k_start:k_end] = dv_d[0].transpose(0, 1)
    return dq, dk, dv


def _document_pairs(cu_q, cu_q_cpu, cu_k, cu_k_cpu, total_q: int, total_k: int):
    """The (query, key) token ranges of every document with queries; refuses a document with more queries than
    keys (its queries must be the last of its keys)."""
    queries = _documents(cu_q, cu_q_cpu, total_q, keep_empty=True)
    keys = _documents(cu_k, cu_k_cpu, total_k, keep_empty=True)
    if len(queries) != len(keys):
        raise ValueError(
            f"varlen_attention_kv: cu_seqlens_q and cu_seqlens_k must describe the same documents, got {len(queries)} "
            f"and {len(keys)}."
        )
    pairs = [(q, k) for q, k in zip(queries, keys) if q[1] > q[0]]
    for (q_start, q_end), (k_start, k_end) in pairs:
        if q_end - q_start > k_end - k_start:
            raise ValueError(
                f"varlen_attention_kv: a document has {q_end - q_start} queries but {k_end - k_start} keys; its "
                "queries must be the last of its keys (cu_seqlens_k must give each document at least as many tokens)."
            )
    return pairs


def _suffix_mask(queries: int, keys: int, causal: bool, window_left: int, device) -> Tensor | None:
    """Boolean ``[Lq, Lk]`` mask (True = attend) for queries that are the last ``Lq`` of ``Lk`` key positions (query
    i sits at key position ``Lk - Lq + i``); None when plain causal (``Lq == Lk``) or full attention suffices."""
    if queries == keys:
        return _window_mask(queries, causal, window_left, device)
    if not causal and window_left == NO_WINDOW:
        return None
    distance = (torch.arange(queries, device=device) + keys - queries)[:, None] - torch.arange(keys, device=device)
    allowed = distance >= 0 if causal else distance >= -window_left
    if window_left != NO_WINDOW:
        allowed &= distance <= window_left
    return allowed


PATH_KV = Path(forward=forward_kv, backward=backward_kv, fake=fake_kv)
