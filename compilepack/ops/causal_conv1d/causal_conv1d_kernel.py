"""The causal conv on CUDA through the causal-conv1d package.

Read at v1.6.1 (commit 0d2252d; the ``cpp_functions`` module exists since v1.5.1). Forward
``causal_conv1d.causal_conv1d_fn(x, weight, bias, seq_idx=, activation=)``; backward the function its
``CausalConv1dFn.backward`` calls, ``causal_conv1d.cpp_functions.causal_conv1d_bwd_function``, so no forward is
re-run in Python. The kernel masks every tap by ``seq_idx`` equality, which for a non-decreasing row is exactly
"same document". It needs channel-last x (``stride(1) == 1``, ``stride(0)`` and ``stride(2)`` multiples of 8),
``D % 8 == 0``, ``2 <= W <= 4``, int32 contiguous ``seq_idx``, bias in weight's dtype with unit stride; x is used
as is when it is a dense channel-last tensor (what transformers passes) and copied into one otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import backends
from .._scaffold import Path
from . import reference

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def applies(x, weight, bias, seq_idx, silu: bool) -> bool:
    """Static shape/dtype facts the kernel needs; anything else runs the reference."""
    dim, width = weight.shape
    return x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES and dim % 8 == 0 and 2 <= width <= 4


def forward(x, weight, bias, seq_idx, silu: bool):
    library = backends.load("causal_conv1d")
    out = library.causal_conv1d_fn(
        _kernel_layout(x),
        weight,
        _kernel_bias(bias, weight),
        seq_idx=_kernel_seq_idx(seq_idx, x),
        activation="silu" if silu else None,
    )
    return out, []


def backward(grad_out, out, saved, needs_grad, x, weight, bias, seq_idx, silu: bool):
    """The kernel computes dx, dweight and dbias in one pass whatever ``needs_grad`` says."""
    library = backends.load("causal_conv1d.cpp_functions")
    dx, dweight, dbias, _ = library.causal_conv1d_bwd_function(
        _kernel_layout(x),
        weight,
        _kernel_bias(bias, weight),
        _kernel_layout(grad_out.to(x.dtype)),
        _kernel_seq_idx(seq_idx, x),
        None,  # initial_states: not allowed together with seq_idx
        None,  # dfinal_states
        None,  # dx: let the library allocate it (empty_like(x): channel-last)
        False,  # return_dinitial_states
        silu,
    )
    return dx, dweight, dbias


# the kernel's output is empty_like of the dense channel-last x it is given: the reference's layout
PATH = Path(forward=forward, backward=backward, fake=reference.fake)


def _kernel_layout(t: Tensor) -> Tensor:
    """``t`` as a dense channel-last ``[B, D, T]`` (the transpose of a contiguous ``[B, T, D]``).

    That layout satisfies every stride rule of the channel-last kernel (``stride(1) == 1``, ``stride(0)`` and
    ``stride(2)`` multiples of 8 since D is) and makes its ``empty_like`` outputs match the op's fake.
    """
    batch, dim, seqlen = t.shape
    if t.stride() == (seqlen * dim, 1, dim) and t.data_ptr() % 16 == 0:
        return t
    dense = torch.empty((batch, seqlen, dim), dtype=t.dtype, device=t.device)
    return dense.copy_(t.transpose(1, 2)).transpose(1, 2)


def _kernel_seq_idx(seq_idx: Tensor, x: Tensor) -> Tensor:
    return seq_idx.to(device=x.device, dtype=torch.int32).contiguous()


def _kernel_bias(bias: Tensor | None, weight: Tensor) -> Tensor | None:
    return None if bias is None else bias.to(weight.dtype).contiguous()
