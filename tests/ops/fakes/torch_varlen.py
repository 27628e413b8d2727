"""A stand-in for torch's varlen attention ops (``torch.ops.torch_attn._varlen_attn`` and
``_varlen_attn_backward``, registered by ``torch.nn.attention.varlen``), each call recorded. Results come from
compilepack's reference path with torch's float32 ``[H, T]`` log-sum-exp. The forward reproduces flash-attn's
one-token-per-sequence shortcut, which torch's copy of ``mha_varlen_fwd`` has (``fakes/flash_attn.py``).

The ops are registered as real custom ops with the signature of one torch release (``RELEASES``: each release's
``_varlen_attn`` / ``_varlen_attn_backward`` parameters as its wheel's ``torch/nn/attention/varlen.py`` declares
them), so the dispatcher binds compilepack's call against that release's schema: an argument the release lacks,
or one too many positionally, fails as it would there.

``FakeTorchVarlen.route(monkeypatch, release)`` makes the ``torch_varlen`` path run on CPU tensors against a fresh
fake with that release's ops."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from compilepack.ops.attention import NO_WINDOW, reference
from tests.ops.fakes import route_kernels
from tests.ops.fakes.flash_attn import varlen_forward_shortcut

MODULE = "torch.nn.attention.varlen"
FLASH = torch.nn.attention.SDPBackend.FLASH_ATTENTION.value

_FORWARD_2_11 = """query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int,
    max_k: int, is_causal: bool = False, scale: float | None = None, window_size: list[int] | None = None"""
_FORWARD_2_12 = """query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None, max_q: int,
    max_k: int, is_causal: bool = False, scale: float | None = None, window_size: list[int] | None = None,
    enable_gqa: bool = False, seqused_k: Tensor | None = None, block_table: Tensor | None = None,
    num_splits: int | None = None"""
_BACKWARD_2_11 = """grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
    cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int, is_causal: bool, rng_state: Tensor,
    scale: float | None = None, window_size: list[int] | None = None"""
_BACKEND = f", backend: int = {FLASH}"

# release -> (forward parameters, backward parameters), read in each wheel's torch/nn/attention/varlen.py: 2.11.0 (the
# forward at line 46), 2.12.0 = 2.12.1 (46), 2.13.0 (46), 2.14.1 (the same 14 and 14), 2.15.0 (233 and 728: +backend)
RELEASES = {
    "2.11.0": (_FORWARD_2_11, _BACKWARD_2_11),
    "2.12.0": (_FORWARD_2_12, _BACKWARD_2_11),
    "2.13.0": (_FORWARD_2_12, _BACKWARD_2_11),
    "2.14.1": (_FORWARD_2_12, _BACKWARD_2_11),
    "2.15.0": (_FORWARD_2_12 + _BACKEND, _BACKWARD_2_11 + _BACKEND),
}
_ACTIVE: dict[str, object] = {}  # namespace -> the fake its ops call


@functools.cache
def release_namespace(release: str) -> str:
    """Register ``release``'s two ops once, in a namespace of their own, calling the active fake; its name."""
    namespace = "cpfake_torch_" + release.replace(".", "_")
    forward, backward = RELEASES[release]
    for name, parameters, returns in (("_varlen_attn", forward, "tuple[Tensor, Tensor, Tensor]"),
                                      ("_varlen_attn_backward", backward, "tuple[Tensor, Tensor, Tensor]")):
        source = f"def {name}({parameters}) -> {returns}:\n    return _call({name!r}, locals())\n"
        scope = {"Tensor": torch.Tensor, "_call": functools.partial(_call_active, namespace)}
        exec(source, scope)  # noqa: S102 - the release's signature, spelled as its wheel declares it
        torch.library.custom_op(f"{namespace}::{name}", scope[name], mutates_args=())
    return namespace


def _call_active(namespace: str, name: str, arguments: dict):
    return getattr(_ACTIVE[namespace], name)(**arguments)


def route_release(monkeypatch: pytest.MonkeyPatch, fake, release: str) -> None:
    """``torch.ops.torch_attn`` becomes ``release``'s ops, answering through ``fake``'s methods."""
    namespace = release_namespace(release)
    monkeypatch.setitem(_ACTIVE, namespace, fake)
    monkeypatch.setattr(torch.ops, "torch_attn", getattr(torch.ops, namespace), raising=False)


def cudnn_would_run(query, key, max_q, window_size, enable_gqa) -> bool:
    """Whether torch 2.14.1's ``_can_use_cudnn`` picks cuDNN for this call on an SM90 GPU with a 16-bit dtype (its
    device, dtype and cuDNN-version conditions taken as met: these tests run fp32 on CPU)."""
    return (max_q > 128 and query.shape[-1] % 8 == 0 and window_size == [-1, -1] and not enable_gqa
            and query.shape[-2] == key.shape[-2])


class FakeTorchVarlen(types.SimpleNamespace):
    """``torch.ops.torch_attn``; ``calls`` lists "forward" / "backward" in call order."""

    def __init__(self, release: str = "2.13.0"):
        super().__init__(calls=[], release=release)

    @classmethod
    def route(cls, monkeypatch: pytest.MonkeyPatch, release: str = "2.13.0") -> FakeTorchVarlen:
        fake = cls(release)
        route_kernels(monkeypatch, "torch_varlen", {MODULE: types.SimpleNamespace()})
        route_release(monkeypatch, fake, release)
        return fake

    def check_release_options(self, query, key, max_q, window_size, enable_gqa, backend) -> None:
        """What each release needs to run flash with these arguments: 2.15 told so (``backend``), 2.14 not handed
        a call its ``_can_use_cudnn`` would send to cuDNN with causal alignment at stake."""
        if self.release == "2.15.0":
            assert backend == FLASH, f"torch 2.15: backend={backend}, not flash ({FLASH})"
        if self.release == "2.14.1":
            assert not cudnn_would_run(query, key, max_q, window_size, enable_gqa), "torch 2.14 would run cuDNN"

    @staticmethod
    def reference_window(is_causal, window_size) -> tuple[bool, int]:
        """torch's (is_causal, window) as the reference's (causal, window_left): is_causal only for an unwindowed
        causal call, with the (-1, 0) window torch's public varlen_attn passes, else a (left, 0) causal or (w, w)
        bidirectional window, (-1, -1) for none."""
        left, right = window_size
        if is_causal:
            assert window_size == [-1, 0], f"is_causal with the window {window_size}"
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
        enable_gqa=None, seqused_k=None, block_table=None, num_splits=None, backend=None,
    ):
        self.calls.append("forward")
        self.check_common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        self.check_release_options(query, key, max_q, window_size, enable_gqa, backend)
        varlen_forward_shortcut(query, key, cu_seq_q, max_q, is_causal, *window_size)
        assert enable_gqa in (None, query.shape[1] != key.shape[1]) and seqused_k is None and block_table is None
        assert num_splits is None and type(scale) is float
        causal, window_left = self.reference_window(is_causal, window_size)
        out, (lse,) = reference.forward(query, key, value, cu_seq_q, cu_seq_q.as_subclass(torch.Tensor), max_q, causal,
                                         scale, window_left)
        return out, lse.float(), torch.zeros(2, dtype=torch.uint64)

    def _varlen_attn_backward(
        self, grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
        scale=None, window_size=None, backend=None,
    ):
        self.calls.append("backward")
        self.check_common(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        self.check_release_options(query, key, max_q, window_size, False, backend)
        assert grad_out.is_contiguous() and rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
        assert lse.dtype == torch.float32 and lse.shape == (query.shape[1], query.shape[0])
        causal, window_left = self.reference_window(is_causal, window_size)
        saved = [lse.to(torch.promote_types(query.dtype, torch.float32))]
        return tuple(reference.backward(
            grad_out, out, saved, [True] * 3, query, key, value, cu_seq_q, cu_seq_q.as_subclass(torch.Tensor), max_q,
            causal, scale, window_left
        ))
