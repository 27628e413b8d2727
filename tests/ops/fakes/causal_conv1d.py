"""A stand-in for the causal-conv1d package (v1.6.1): ``causal_conv1d.causal_conv1d_fn`` and
``causal_conv1d.cpp_functions.causal_conv1d_bwd_function``, with the library's argument names (a renamed or extra
argument fails here with a TypeError), each call recorded, and the layout and dtype checks of its C++ entry points
(``csrc/causal_conv1d.cpp``) asserted.

Results come from compilepack's reference path, allocated as the library allocates them (``empty_like(x)`` for out
and dx, weight's dtype for dweight, None for dbias without bias), so a path's wiring is tested, not the kernel's
numerics."""

from __future__ import annotations

import types

import torch

from compilepack.ops.causal_conv1d import reference

MODULES = ("causal_conv1d", "causal_conv1d.cpp_functions")


def assert_channel_last_for_kernel(t, name):
    assert t.stride(1) == 1 and t.stride(2) > 1, f"{name} must be channel-last, strides {t.stride()}"
    assert t.stride(0) % 8 == 0 and t.stride(2) % 8 == 0 and t.shape[1] % 8 == 0, f"{name} strides {t.stride()}"


class FakeCausalConv1d(types.SimpleNamespace):
    """Both modules in one object: route every name of ``MODULES`` to it."""

    def __init__(self):
        super().__init__(calls=[])

    @staticmethod
    def check_common(x, weight, bias, seq_idx):
        batch, dim, seqlen = x.shape
        assert_channel_last_for_kernel(x, "x")
        assert weight.shape == (dim, weight.shape[1]) and 2 <= weight.shape[1] <= 4
        assert bias is None or (bias.dtype == weight.dtype and bias.stride(-1) == 1)
        assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (batch, seqlen)
        assert seq_idx.device == x.device

    def causal_conv1d_fn(self, x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        self.calls.append("fwd")
        self.check_common(x, weight, bias, seq_idx)
        assert initial_states is None and return_final_states is False and final_states_out is None
        assert activation in (None, "silu")
        out, _ = reference.forward(x, weight, bias, seq_idx, activation == "silu")
        return torch.empty_like(x).copy_(out)

    def causal_conv1d_bwd_function(self, x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
                                   return_dinitial_states, silu_activation):
        self.calls.append("bwd")
        self.check_common(x, weight, bias, seq_idx)
        assert_channel_last_for_kernel(dout, "dout")
        assert dout.dtype == x.dtype
        assert initial_states is None and dfinal_states is None and dx is None
        assert return_dinitial_states is False and type(silu_activation) is bool
        needs = [True, True, bias is not None]
        ref_dx, ref_dweight, ref_dbias = reference.backward(
            dout, None, [], needs, x, weight, bias, seq_idx, silu_activation
        )
        dx = torch.empty_like(x).copy_(ref_dx)
        dbias = None if bias is None else ref_dbias.to(bias.dtype)
        return dx, ref_dweight.to(weight.dtype).contiguous(), dbias, None
