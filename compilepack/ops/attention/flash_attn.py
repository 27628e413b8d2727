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

from ... import backends
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
