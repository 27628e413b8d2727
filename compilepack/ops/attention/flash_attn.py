"""Varlen attention on CUDA through flash-attn 2's varlen forward/backward functions
(``flash_attn.flash_attn_interface._flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward``, read in 2.7).

flash-attn's log-sum-exp is float32 ``[H, T]``, whatever the inputs' dtype; the backward writes into the gradient
buffers it is given. The device ``cu_seqlens`` is what the kernels read; the host copy is not needed.

Zero-length documents are fine for the kernels (a block of an empty sequence returns at once,
``flash_fwd_kernel.h``/``flash_bwd_kernel.h``), but not for one shortcut of ``mha_varlen_fwd``
(``csrc/flash_attn/flash_api.cpp``, 2.7.0 to 2.8.3, and torch's copy of it): with ``max_seqlen_q == 1``, more query
than key heads and no window it reshapes q as one token per sequence (``seqlenq_ngroups_swapped``), which raises
when a sequence is empty (flash-attn #1537). ``max_seqlen`` is only a bound, so the kernels are handed at least 2
(:func:`kernel_max_seqlen`): identical results, never that shortcut.
"""

from __future__ import annotations

import torch

from .. import backends
from .._scaffold import Path

FLASH_MODULE = "flash_attn.flash_attn_interface"
SHORTCUT_MAX_SEQLEN = 1  # the max_seqlen_q at which mha_varlen_fwd takes its one-token-per-sequence shortcut


def kernel_max_seqlen(max_seqlen: int) -> int:
    """The bound handed to the flash kernels: ``max_seqlen``, but never the shortcut's value (see above)."""
    return max(int(max_seqlen), SHORTCUT_MAX_SEQLEN + 1)


def _window(causal: bool, window_left: int) -> tuple[int, int]:
    """flash-attn's (left, right) window; -1 means unbounded, right=0 with causal=True is plain causal."""
    return window_left, (0 if causal else window_left)


def forward(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale, window_left):
    flash = backends.load(FLASH_MODULE)
    left, right = _window(causal, window_left)
    max_seqlen = kernel_max_seqlen(max_seqlen)
    out, lse, _, _ = flash._flash_attn_varlen_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=0.0, alibi_slopes=None, return_softmax=False,
    )
    return out[..., : v.shape[-1]].contiguous(), [lse]


def fake(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale, window_left):
    total, heads = q.shape[:2]
    return q.new_empty(total, heads, v.shape[2]), [q.new_empty(heads, total, dtype=torch.float32)]


def backward(grad_out, out, saved, needs_grad, q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale,
             window_left):
    flash = backends.load(FLASH_MODULE)
    (lse,) = saved
    left, right = _window(causal, window_left)
    max_seqlen = kernel_max_seqlen(max_seqlen)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flash._flash_attn_varlen_backward(
        grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out, lse, dq, dk, dv,
        cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
    )
    return dq, dk, dv


PATH = Path(forward=forward, backward=backward, fake=fake)


# ------------------------------------------------------------------------------------------------ keys beyond queries
#
# ``compilepack::varlen_attention_kv``: the same functions with separate query and key boundaries; with ``causal``
# flash-attn (>= 2.1) aligns the mask at the bottom right of each document, as the reference does. A document with
# more queries than keys is not that convention: flash-attn leaves its first queries' rows unwritten (flash-attn
# #1778); the context-parallel caller never builds one, and a direct call is refused on the host copies.


def refuse_more_queries_than_keys(cu_seqlens_q_cpu, cu_seqlens_k_cpu) -> None:
    """Refuse, from the host copies when both are given (free to read), a document with more queries than keys."""
    if cu_seqlens_q_cpu is None or cu_seqlens_k_cpu is None or cu_seqlens_q_cpu.shape != cu_seqlens_k_cpu.shape:
        return
    excess = cu_seqlens_q_cpu.diff() > cu_seqlens_k_cpu.diff()
    if bool(excess.any()):
        document = int(excess.nonzero()[0, 0])
        raise ValueError(
            f"varlen_attention_kv: document {document} has more queries than keys "
            f"({int(cu_seqlens_q_cpu.diff()[document])} > {int(cu_seqlens_k_cpu.diff()[document])}); its queries must "
            "be the last of its keys. The CUDA kernels would leave its first queries' outputs unwritten (flash-attn "
            "#1778)."
        )


def forward_kv(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k,
               causal, scale, window_left):
    refuse_more_queries_than_keys(cu_seqlens_q_cpu, cu_seqlens_k_cpu)
    flash = backends.load(FLASH_MODULE)
    left, right = _window(causal, window_left)
    out, lse, _, _ = flash._flash_attn_varlen_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q, cu_seqlens_k, kernel_max_seqlen(max_seqlen_q),
        kernel_max_seqlen(max_seqlen_k), dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=left,
        window_size_right=right, softcap=0.0, alibi_slopes=None, return_softmax=False,
    )
    return out[..., : v.shape[-1]].contiguous(), [lse]


def fake_kv(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k,
            causal, scale, window_left):
    return fake(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, max_seqlen_q, causal, scale, window_left)


def backward_kv(grad_out, out, saved, needs_grad, q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k,
                cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k, causal, scale, window_left):
    flash = backends.load(FLASH_MODULE)
    (lse,) = saved
    left, right = _window(causal, window_left)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flash._flash_attn_varlen_backward(
        grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out, lse, dq, dk, dv,
        cu_seqlens_q, cu_seqlens_k, kernel_max_seqlen(max_seqlen_q), kernel_max_seqlen(max_seqlen_k),
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
    )
    return dq, dk, dv


PATH_KV = Path(forward=forward_kv, backward=backward_kv, fake=fake_kv)
