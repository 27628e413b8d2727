"""``compilepack::varlen_attention``: attention over packed documents, each attending only to itself.

Layout follows flash-attn's varlen functions: tokens of all documents are concatenated along dim 0.

- ``q``: ``[T, H, D]``; ``k``: ``[T, Hkv, D]``; ``v``: ``[T, Hkv, Dv]`` with ``H`` a multiple of ``Hkv`` (GQA);
  ``Dv`` may differ from ``D`` (MLA): the public function pads to one head dim, exactly
- ``cu_seqlens``: ``int32 [N+1]``, document ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``
- ``max_seqlen``: Python int, an upper bound of the longest document (the row length is always safe)
- returns ``[T, H, Dv]``

Backends: the reference loops over documents (CPU flash-attention kernels per document on CPU, explicit math
elsewhere); on CUDA, ``flash_attn`` calls flash-attn's varlen kernels and ``torch_varlen`` torch's own
``torch.ops.torch_attn._varlen_attn``. The forward returns the log-sum-exp so every backward is explicit.
"""

from __future__ import annotations

import math

import torch

from .. import backends
from ._common import host_boundaries

NO_WINDOW = -1


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    *,
    backend: str = backends.REFERENCE,
) -> torch.Tensor:
    """Attention of every packed document with itself only.

    Args:
        q: ``[T, H, D]`` queries of all documents, concatenated.
        k: ``[T, Hkv, D]`` keys; ``H % Hkv == 0`` (grouped-query attention).
        v: ``[T, Hkv, Dv]`` values.
        cu_seqlens: ``int32 [N+1]`` document boundaries (0, ..., T); zero-length documents are allowed.
        max_seqlen: Python int upper bound of the longest document; a larger value gives identical results.
        causal: causal attention inside each document.
        scale: softmax scale, default ``D ** -0.5``.
        window: sliding window as transformers counts it (a query sees itself and ``window - 1`` earlier
            tokens), or None for full attention.
        backend: CUDA library used when the tensors are on CUDA (``flash_attn``, ``torch_varlen``,
            ``reference``); chosen once by ``compilepack.patch``.

    Returns:
        ``[T, H, Dv]`` in q's dtype.
    """
    _check_shapes(q, k, v, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    window_left = NO_WINDOW if window is None else int(window) - 1
    q, k, v, value_dim = _common_head_dim(q, k, v)
    out, _lse = torch.ops.compilepack.varlen_attention(
        q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left, backend
    )
    return out[..., :value_dim]


def _common_head_dim(q, k, v):
    """Zero-pad q/k or v to one head dim (MLA: values narrower than queries). The flash kernels (CPU, flash-attn
    2, torch varlen) take a single head dim; zero query/key columns add nothing to the scores and zero value
    columns only produce output columns that are cut off, so the result and its gradients are exact."""
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    if value_dim < head_dim:
        v = torch.nn.functional.pad(v, (0, head_dim - value_dim))
    elif head_dim < value_dim:
        q, k = (torch.nn.functional.pad(x, (0, value_dim - head_dim)) for x in (q, k))
    return q, k, v, value_dim


def _check_shapes(q, k, v, cu_seqlens) -> None:
    """Shape/dtype errors a caller can fix, raised before any compute (static facts only, safe to trace)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention expects q, k, v as [T, heads, head_dim]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}. Flatten the batch: x.reshape(-1, heads, head_dim)."
        )
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"varlen_attention: query heads ({q.shape[1]}) must be a multiple of key/value heads "
            f"(k {k.shape[1]}, v {v.shape[1]})."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"varlen_attention: cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}; use cu_seqlens.to(torch.int32)."
        )


# ----------------------------------------------------------------------------------------------- custom ops


@torch.library.custom_op("compilepack::varlen_attention", mutates_args=())
def _varlen_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float,
    window_left: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backends.use_kernel(q, backend):
        return _KERNEL_FORWARD[backend](q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left)
    return _reference_forward(q, k, v, cu_seqlens, causal, scale, window_left)


@_varlen_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left, backend):
    total, heads = q.shape[0], q.shape[1]
    out = q.new_empty(total, heads, v.shape[2])
    lse = q.new_empty(heads, total, dtype=torch.float32)
    return out, lse


@torch.library.custom_op("compilepack::varlen_attention_backward", mutates_args=())
def _varlen_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float,
    window_left: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out = grad_out.contiguous()
    if backends.use_kernel(q, backend):
        return _KERNEL_BACKWARD[backend](
            grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, window_left
        )
    return _reference_backward(grad_out, q, k, v, out, lse, cu_seqlens, causal, scale, window_left)


@_varlen_attention_bwd.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, window_left, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = (max_seqlen, causal, scale, window_left, backend)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    max_seqlen, causal, scale, window_left, backend = ctx.args
    dq, dk, dv = torch.ops.compilepack.varlen_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, window_left, backend
    )
    return dq, dk, dv, None, None, None, None, None, None


_varlen_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- reference


def _documents(cu_seqlens: torch.Tensor, total: int):
    """(start, end) of every non-empty document; refuses boundaries that do not cover the tokens exactly."""
    bounds = host_boundaries(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"varlen_attention: cu_seqlens must start at 0 and end at the token count {total}; "
            f"got {bounds[0]} ... {bounds[-1]}. Tokens outside the documents would be dropped."
        )
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


def _heads_first(x: torch.Tensor, start: int, end: int, groups: int) -> torch.Tensor:
    """Document slice of ``[T, h, d]`` as ``[1, h * groups, L, d]`` (GQA heads repeated for the kernel)."""
    x = x[start:end].transpose(0, 1)
    if groups > 1:
        x = x.repeat_interleave(groups, dim=0)
    return x.unsqueeze(0)


def _window_mask(length: int, causal: bool, window_left: int, device) -> torch.Tensor | None:
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


def _reference_forward(q, k, v, cu_seqlens, causal, scale, window_left):
    total, heads = q.shape[0], q.shape[1]
    groups = heads // k.shape[1]
    out = q.new_zeros(total, heads, v.shape[2])
    lse = q.new_zeros(heads, total, dtype=torch.float32)
    for start, end in _documents(cu_seqlens, total):
        qd, kd, vd = (_heads_first(x, start, end, g) for x, g in ((q, 1), (k, groups), (v, groups)))
        mask = _window_mask(end - start, causal, window_left, q.device)
        od, lsed = _document_forward(qd, kd, vd, causal, scale, mask)
        out[start:end] = od[0].transpose(0, 1)
        lse[:, start:end] = lsed[0]
    return out, lse


def _reference_backward(grad_out, q, k, v, out, lse, cu_seqlens, causal, scale, window_left):
    total, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    groups = heads // kv_heads
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start, end in _documents(cu_seqlens, total):
        qd, kd, vd = (_heads_first(x, start, end, g) for x, g in ((q, 1), (k, groups), (v, groups)))
        od, dod = _heads_first(out, start, end, 1), _heads_first(grad_out, start, end, 1)
        lsed = lse[:, start:end].unsqueeze(0)
        mask = _window_mask(end - start, causal, window_left, q.device)
        dqd, dkd, dvd = _document_backward(dod, qd, kd, vd, od, lsed, causal, scale, mask)
        length = end - start
        dq[start:end] = dqd[0].transpose(0, 1)
        # GQA: a key/value head's gradient is the sum over the query heads that shared it
        dk[start:end] = dkd[0].view(kv_heads, groups, length, -1).sum(1).transpose(0, 1)
        dv[start:end] = dvd[0].view(kv_heads, groups, length, -1).sum(1).transpose(0, 1)
    return dq, dk, dv


def _document_forward(q, k, v, causal, scale, mask):
    """One document, ``[1, H, L, D]``: output and log-sum-exp ``[1, H, L]``."""
    if q.device.type == "cpu":
        # CPU flash attention: tiled, never materialises the L x L scores, returns the lse we need.
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and mask is None, attn_mask=_additive(mask, q.dtype), scale=scale
        )
    scores = _masked_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return (probs @ v.float()).to(q.dtype), lse


def _document_backward(grad_out, q, k, v, out, lse, causal, scale, mask):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal and mask is None, attn_mask=_additive(mask, q.dtype), scale=scale
        )
    scores = _masked_scores(q, k, causal, scale, mask)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    grad_out32 = grad_out.float()
    grad_v = probs.transpose(-1, -2) @ grad_out32
    grad_probs = grad_out32 @ v.float().transpose(-1, -2)
    delta = (grad_out32 * out.float()).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - delta) * scale
    grad_q = grad_scores @ k.float()
    grad_k = grad_scores.transpose(-1, -2) @ q.float()
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """The CPU flash kernel takes a float mask of the query dtype: 0 where allowed, -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def _masked_scores(q, k, causal, scale, mask):
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    length = q.shape[-2]
    if mask is None and causal:
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return scores


# ----------------------------------------------------------------------------------------------- CUDA kernels


def _flash_window(causal: bool, window_left: int) -> tuple[int, int]:
    """flash-attn's (left, right) window; -1 means unbounded, right=0 with causal=True is plain causal."""
    return window_left, (0 if causal else window_left)


def _flash_attn_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left):
    flash = backends.load("flash_attn.flash_attn_interface")
    left, right = _flash_window(causal, window_left)
    out, lse, _, _ = flash._flash_attn_varlen_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=0.0, alibi_slopes=None, return_softmax=False,
    )
    return out[..., : v.shape[-1]].contiguous(), lse


def _flash_attn_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, window_left):
    flash = backends.load("flash_attn.flash_attn_interface")
    left, right = _flash_window(causal, window_left)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flash._flash_attn_varlen_backward(
        grad_out, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, dq, dk, dv,
        cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
    )
    return dq, dk, dv


def _torch_varlen_window(causal: bool, window_left: int) -> tuple[bool, list[int]]:
    """torch's varlen op takes is_causal only for unwindowed causal attention, else a (left, right) window."""
    if causal and window_left == NO_WINDOW:
        return True, [-1, -1]
    return False, [window_left, 0 if causal else window_left]


def _torch_varlen_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left):
    backends.load("torch.nn.attention.varlen")  # registers torch.ops.torch_attn
    is_causal, window = _torch_varlen_window(causal, window_left)
    out, lse, _ = torch.ops.torch_attn._varlen_attn(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        is_causal, scale, window, q.shape[1] != k.shape[1], None, None, None,
    )
    return out, lse


def _torch_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, window_left):
    backends.load("torch.nn.attention.varlen")
    is_causal, window = _torch_varlen_window(causal, window_left)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
    dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
        grad_out, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, cu_seqlens, cu_seqlens,
        max_seqlen, max_seqlen, is_causal, rng_state, scale, window,
    )
    return dq, dk, dv


_KERNEL_FORWARD = {"flash_attn": _flash_attn_forward, "torch_varlen": _torch_varlen_forward}
_KERNEL_BACKWARD = {"flash_attn": _flash_attn_backward, "torch_varlen": _torch_varlen_backward}
