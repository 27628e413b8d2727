"""A stand-in for torch's varlen attention ops (``torch.ops.torch_attn._varlen_attn`` and
``_varlen_attn_backward``, registered by ``torch.nn.attention.varlen``), with torch's parameter names and defaults,
each call recorded. Results come from compilepack's reference path with torch's float32 ``[H, T]`` log-sum-exp.
The forward reproduces flash-attn's one-token-per-sequence shortcut, which torch's copy of ``mha_varlen_fwd`` has
(``fakes/flash_attn.py``): torch passes ``is_causal`` with a ``(-1, -1)`` window, so causal attention reaches it.

``FakeTorchVarlen.route(monkeypatch)`` makes the ``torch_varlen`` path run on CPU tensors against a fresh fake."""

from __future__ import annotations

import types

import pytest
import torch

from compilepack.ops.attention import NO_WINDOW, reference
from tests.ops.fakes import route_kernels
from tests.ops.fakes.flash_attn import varlen_forward_shortcut

MODULE = "torch.nn.attention.varlen"


class FakeTorchVarlen(types.SimpleNamespace):
    """``torch.ops.torch_attn``; ``calls`` lists "forward" / "backward" in call order."""

    def __init__(self):
        super().__init__(calls=[])

    @classmethod
    def route(cls, monkeypatch: pytest.MonkeyPatch) -> FakeTorchVarlen:
        fake = cls()
        route_kernels(monkeypatch, "torch_varlen", {MODULE: types.SimpleNamespace()})
        monkeypatch.setattr(torch.ops, "torch_attn", fake, raising=False)
        return fake

    @staticmethod
    def reference_window(is_causal, window_size) -> tuple[bool, int]:
        """torch's (is_causal, window) as the reference's (causal, window_left): is_causal only for an unwindowed
        causal call, else a (left, 0) causal or (w, w) bidirectional window, (-1, -1) for none."""
        left, right = window_size
        if is_causal:
            assert window_size == [-1, -1], "is_causal with a window: torch would apply both"
            return True, NO_WINDOW
        assert right in (0, left), f"unexpected window {window_size}"
        return right == 0 and left != -1, left

    @staticmethod
    def check_common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        for x in (query, key, value):
            assert x.dim() == 3 and x.is_contiguous()
        assert cu_seq_q.dtype == torch.int32 and (cu_seq_k is cu_seq_q or torch.equal(cu_seq_k, cu_seq_q))
        assert type(max_q) is int and max_q == max_k

    def _varlen_attn(
        self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
        enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
    ):
        self.calls.append("forward")
        self.check_common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        varlen_forward_shortcut(query, key, cu_seq_q, max_q, is_causal, *window_size)
        assert enable_gqa == (query.shape[1] != key.shape[1]) and seqused_k is None and block_table is None
        assert num_splits is None and type(scale) is float
        causal, window_left = self.reference_window(is_causal, window_size)
        out, (lse,) = reference.forward(query, key, value, cu_seq_q, cu_seq_q.as_subclass(torch.Tensor), max_q, causal, scale,
                                         window_left)
        return out, lse.float(), torch.zeros(2, dtype=torch.uint64)

    def _varlen_attn_backward(
        self, grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
        scale=None, window_size=None,
    ):
        self.calls.append("backward")
        self.check_common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        assert grad_out.is_contiguous() and rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
        assert lse.dtype == torch.float32 and lse.shape == (query.shape[1], query.shape[0])
        causal, window_left = self.reference_window(is_causal, window_size)
        saved = [lse.to(torch.promote_types(query.dtype, torch.float32))]
        return tuple(reference.backward(
            grad_out, out, saved, [True] * 3, query, key, value, cu_seq_q, cu_seq_q.as_subclass(torch.Tensor), max_q,
            causal, scale, window_left
        ))
