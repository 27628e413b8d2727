"""Varlen attention on CUDA through torch's own varlen ops (``torch.ops.torch_attn._varlen_attn`` and
``_varlen_attn_backward``, registered by importing ``torch.nn.attention.varlen``).

The forward returns the output (q's shape), a float32 ``[H, T]`` log-sum-exp and an rng state; without dropout the
state is unused, so the backward is handed zeros. GQA is the op's ``enable_gqa`` flag.

torch's kernels are flash-attn 2's (``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``), with its
one-token-per-sequence shortcut at ``max_seqlen_q == 1`` that fails on empty sequences; causal attention without
a window reaches it here too (``is_causal`` is dropped at ``max_seqlen_q == 1``, leaving no window). The kernels are
handed a bound of at least 2, as in ``flash_attn.py``.
"""

from __future__ import annotations

import torch

from .. import backends
from .._scaffold import Path
from .flash_attn import kernel_max_seqlen, refuse_more_queries_than_keys
from .reference import NO_WINDOW

TORCH_VARLEN_MODULE = "torch.nn.attention.varlen"


def _window(causal: bool, window_left: int) -> tuple[bool, list[int]]:
    """torch's varlen op takes is_causal only for unwindowed causal attention, else a (left, right) window."""
    if causal and window_left == NO_WINDOW:
        return True, [-1, -1]
    return False, [window_left, 0 if causal else window_left]


def forward(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale, window_left):
    backends.load(TORCH_VARLEN_MODULE)  # registers torch.ops.torch_attn
    is_causal, window = _window(causal, window_left)
    max_seqlen = kernel_max_seqlen(max_seqlen)
    out, lse, _ = torch.ops.torch_attn._varlen_attn(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        is_causal, scale, window, q.shape[1] != k.shape[1], None, None, None,
    )
    return out, [lse]


def fake(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale, window_left):
    total, heads = q.shape[:2]
    return q.new_empty(total, heads, v.shape[2]), [q.new_empty(heads, total, dtype=torch.float32)]


def backward(grad_out, out, saved, needs_grad, q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale,
             window_left):
    backends.load(TORCH_VARLEN_MODULE)
    (lse,) = saved
    is_causal, window = _window(causal, window_left)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
    max_seqlen = kernel_max_seqlen(max_seqlen)
    dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
        grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out, lse, cu_seqlens, cu_seqlens,
        max_seqlen, max_seqlen, is_causal, rng_state, scale, window,
    )
    return dq, dk, dv


PATH = Path(forward=forward, backward=backward, fake=fake)


# ------------------------------------------------------------------------------------------------ keys beyond queries
#
# ``compilepack::varlen_attention_kv`` on torch's varlen ops, separate query and key boundaries (flash-attn's
# bottom-right causal alignment, as in ``flash_attn.py``). torch's private forward op has changed its parameters
# between releases (14 in 2.13 with ``enable_gqa``; other builds have 10, or 16 with cache arguments and no
# ``enable_gqa``), while the first seven and ``is_causal``, ``scale``, ``window_size`` keep their names: they are
# passed by name, and ``enable_gqa`` only when q has more heads than k (where a build has it; flash kernels without it
# take grouped heads as they come). The backward op's 14 parameters are the same in the releases read.


def forward_kv(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k,
               causal, scale, window_left):
    refuse_more_queries_than_keys(cu_seqlens_q_cpu, cu_seqlens_k_cpu)
    backends.load(TORCH_VARLEN_MODULE)  # registers torch.ops.torch_attn
    is_causal, window = _window(causal, window_left)
    grouped = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    out, lse, _ = torch.ops.torch_attn._varlen_attn(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q, cu_seqlens_k, kernel_max_seqlen(max_seqlen_q),
        kernel_max_seqlen(max_seqlen_k), is_causal=is_causal, scale=scale, window_size=window, **grouped,
    )
    return out, [lse]


def fake_kv(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k,
            causal, scale, window_left):
    return fake(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, max_seqlen_q, causal, scale, window_left)


def backward_kv(grad_out, out, saved, needs_grad, q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k,
                cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k, causal, scale, window_left):
    backends.load(TORCH_VARLEN_MODULE)
    (lse,) = saved
    is_causal, window = _window(causal, window_left)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
    dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
        grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out, lse, cu_seqlens_q, cu_seqlens_k,
        kernel_max_seqlen(max_seqlen_q), kernel_max_seqlen(max_seqlen_k), is_causal, rng_state, scale=scale,
        window_size=window,
    )
    return dq, dk, dv


PATH_KV = Path(forward=forward_kv, backward=backward_kv, fake=fake_kv)
