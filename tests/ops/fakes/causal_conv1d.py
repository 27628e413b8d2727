"""A stand-in for the causal-conv1d package (v1.6.1): ``causal_conv1d.causal_conv1d_fn`` and
``causal_conv1d.cpp_functions.causal_conv1d_bwd_function``, with the library's argument names (a renamed or extra
argument fails here with a TypeError), each call recorded, and the layout and dtype checks of its C++ entry points
(``csrc/causal_conv1d.cpp``) asserted.

Results come from compilepack's reference path, allocated as the library allocates them (``empty_like(x)`` for out
and dx, weight's dtype for dweight, None for dbias without bias), so a path's wiring is tested, not the kernel's
numerics.

Two reported bugs of every release (1.5.1 to 1.6.1.post4) are reproduced as the kernels' contract, so a path that
does not guard against them fails here as it would on the GPU:

- the channel-last forward reads ``seq_idx`` in whole chunks of 64 tokens, checking only the lower bound
  (``csrc/causal_conv1d_fwd.cu``; causal-conv1d #117): the read must stay inside ``seq_idx``'s storage, else
  ``IndexError`` (on the GPU an illegal read);
- x is indexed with uint32 offsets (``csrc/causal_conv1d.h``; causal-conv1d #114): ``UINT32_ELEMENTS`` elements or
  more raise ``OverflowError`` (on the GPU a silent wrap). A test lowers the class attribute to reach it."""

from __future__ import annotations

import types

import torch

from compilepack.ops.causal_conv1d import reference

MODULES = ("causal_conv1d", "causal_conv1d.cpp_functions")
FORWARD_CHUNK = 64  # the channel-last forward kernel's tokens per block (kChunkSizeL)


def read_seq_idx_as_the_forward_kernel_does(seq_idx):
    """Every row of ``seq_idx`` read in whole chunks of ``FORWARD_CHUNK`` tokens: up to 63 ints past a row's end,
    past the tensor itself for the last row. ``IndexError`` when that leaves ``seq_idx``'s storage."""
    batch, seqlen = seq_idx.shape
    reach = (batch - 1) * seqlen + -(-seqlen // FORWARD_CHUNK) * FORWARD_CHUNK
    stored = seq_idx.untyped_storage().nbytes() // seq_idx.element_size() - seq_idx.storage_offset()
    if reach > stored:
        raise IndexError(
            f"causal-conv1d's forward reads seq_idx up to element {reach} from its start, its storage holds {stored} "
            "(causal-conv1d #117: an out-of-bounds read on the GPU)"
        )


def assert_channel_last_for_kernel(t, name):
    assert t.stride(1) == 1 and t.stride(2) > 1, f"{name} must be channel-last, strides {t.stride()}"
    assert t.stride(0) % 8 == 0 and t.stride(2) % 8 == 0 and t.shape[1] % 8 == 0, f"{name} strides {t.stride()}"


class FakeCausalConv1d(types.SimpleNamespace):
    """Both modules in one object: route every name of ``MODULES`` to it."""

    UINT32_ELEMENTS = 2**32  # x's element count at which the kernels' uint32 offsets wrap

    def __init__(self):
        super().__init__(calls=[])

    def check_common(self, x, weight, bias, seq_idx):
        batch, dim, seqlen = x.shape
        if x.numel() >= self.UINT32_ELEMENTS:
            raise OverflowError(f"x has {x.numel()} elements: causal-conv1d's uint32 offsets wrap (causal-conv1d #114)")
        assert_channel_last_for_kernel(x, "x")
        assert weight.shape == (dim, weight.shape[1]) and 2 <= weight.shape[1] <= 4
        assert bias is None or (bias.dtype == weight.dtype and bias.stride(-1) == 1)
        assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (batch, seqlen)
        assert seq_idx.device == x.device

    def causal_conv1d_fn(self, x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        self.calls.append("fwd")
        self.check_common(x, weight, bias, seq_idx)
        read_seq_idx_as_the_forward_kernel_does(seq_idx)
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
