"""A stand-in for flash-attn 2's ``flash_attn.flash_attn_interface`` (2.7): the varlen forward/backward functions
compilepack's ``flash_attn`` path calls, with flash-attn's parameter names and defaults (a renamed or extra
argument fails here with a TypeError), each call recorded.

Results come from compilepack's reference path, with flash-attn's float32 ``[H, T]`` log-sum-exp, so the path's
wiring is tested, not flash-attn's numerics (``python -m tools.gpu_check`` runs the real kernels).

The forward reproduces ``mha_varlen_fwd``'s one-token-per-sequence shortcut (``csrc/flash_attn/flash_api.cpp``,
2.7.0 to 2.8.3; torch's copy has it too): at ``max_seqlen_q == 1`` it drops ``is_causal``, and without a window and
with more query than key heads it reshapes q as one token per sequence, which raises when a sequence is empty
(flash-attn #1537)."""

from __future__ import annotations

import types

import torch

from compilepack.ops.attention import reference


def varlen_forward_shortcut(q, k, cu_seqlens_q, max_seqlen_q, causal, window_size_left, window_size_right):
    """``mha_varlen_fwd``'s ``seqlenq_ngroups_swapped``: the same reshape, so an empty sequence raises as there."""
    if max_seqlen_q == 1:
        causal = False  # "causal=true is the same as causal=false in this case"
    if causal:
        window_size_right = 0
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if max_seqlen_q == 1 and heads > kv_heads and window_size_left < 0 and window_size_right < 0 and head_dim % 8 == 0:
        q.reshape(cu_seqlens_q.numel() - 1, kv_heads, heads // kv_heads, head_dim)


class FakeFlashAttn(types.SimpleNamespace):
    """``flash_attn.flash_attn_interface``; ``calls`` lists "forward" / "backward" in call order."""

    def __init__(self):
        super().__init__(calls=[])

    @staticmethod
    def check_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        for x in (q, k, v):
            assert x.dim() == 3 and x.is_contiguous(), "flash-attn varlen wants contiguous [T, heads, head_dim]"
        assert q.shape[1] % k.shape[1] == 0 and q.shape[-1] == k.shape[-1] == v.shape[-1]
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.device == q.device
        assert cu_seqlens_q is cu_seqlens_k or torch.equal(cu_seqlens_q, cu_seqlens_k)
        assert type(max_seqlen_q) is int and max_seqlen_q == max_seqlen_k

    @staticmethod
    def reference_inputs(q, k, v, cu_seqlens, max_seqlen, causal, window_size_left, window_size_right):
        """flash-attn's arguments as the reference path's inputs (its window is (left, 0) causal, (w, w) not). The
        library reads device boundaries on the device; the stand-in computes with the host's (a plain tensor)."""
        assert window_size_right == (0 if causal else window_size_left)
        return q, k, v, cu_seqlens, cu_seqlens.as_subclass(torch.Tensor), max_seqlen, causal

    def _flash_attn_varlen_forward(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
        block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False,
    ):
        self.calls.append("forward")
        self.check_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        varlen_forward_shortcut(q, k, cu_seqlens_q, max_seqlen_q, causal, window_size_left, window_size_right)
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and return_softmax is False
        assert type(softmax_scale) is float
        inputs = self.reference_inputs(q, k, v, cu_seqlens_q, max_seqlen_q, causal, window_size_left, window_size_right)
        out, (lse,) = reference.forward(*inputs, softmax_scale, window_size_left)
        return out, lse.float(), None, torch.zeros(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(
        self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
        rng_state=None, zero_tensors=False,
    ):
        self.calls.append("backward")
        self.check_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        assert dout.is_contiguous() and dout.shape == out.shape == q.shape
        assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[1], q.shape[0])
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
        for buffer, x in ((dq, q), (dk, k), (dv, v)):
            assert buffer.shape == x.shape and buffer.dtype == x.dtype and buffer.is_contiguous()
        inputs = self.reference_inputs(q, k, v, cu_seqlens_q, max_seqlen_q, causal, window_size_left, window_size_right)
        saved = [softmax_lse.to(torch.promote_types(q.dtype, torch.float32))]
        grads = reference.backward(dout, out, saved, [True] * 3, *inputs, softmax_scale, window_size_left)
        for buffer, grad in zip((dq, dk, dv), grads):  # flash-attn writes into the buffers it is given
            buffer.copy_(grad)
        return torch.empty(q.shape[1], q.shape[0])  # softmax_d
