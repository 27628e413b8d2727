"""The causal conv on CUDA through the causal-conv1d package.

Read at v1.6.1 (commit 0d2252d; the ``cpp_functions`` module exists since v1.5.1). Forward
``causal_conv1d.causal_conv1d_fn(x, weight, bias, seq_idx=, activation=)``; backward the function its
``CausalConv1dFn.backward`` calls, ``causal_conv1d.cpp_functions.causal_conv1d_bwd_function``, so no forward is
re-run in Python. The kernel masks every tap by ``seq_idx`` equality, which for a non-decreasing row is exactly
"same document". It needs channel-last x (``stride(1) == 1``, ``stride(0)`` and ``stride(2)`` multiples of 8),
``D % 8 == 0``, ``2 <= W <= 4``, int32 contiguous ``seq_idx``, bias in weight's dtype with unit stride; x is used
as is when it is a dense channel-last tensor (what transformers passes) and copied into one otherwise.

Two bugs of every release compilepack admits (1.5.1 to 1.6.1.post4) are guarded here, without a host sync
(docs/kernels.md):

- the channel-last forward reads ``seq_idx`` in whole chunks of 64 tokens and checks only the lower bound
  (``csrc/causal_conv1d_fwd.cu``, ``seq_idx_thread[i] = ... >= 0 ? seq_idx[...] : -1``; the backward checks both;
  causal-conv1d #117, open): a row whose length is not a multiple of 64 is read up to 63 ints past its end, past
  the allocation for the last row. Those values only reach outputs past the row's end, which are never stored,
  but the read can fault. The kernel gets a ``seq_idx`` whose storage holds that tail (:func:`_kernel_seq_idx`);
- x, out and dx are indexed with uint32 offsets (``ConvParamsBase::index_t``, ``csrc/causal_conv1d.h``;
  causal-conv1d #114, open), which wrap silently from 2**32 elements: larger inputs run the reference
  (:func:`applies`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import backends
from .._scaffold import Path
from . import reference

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SEQ_IDX_CHUNK = 64  # the forward kernel's chunk of tokens (kChunkSizeL): how far past a row's end it reads seq_idx
UINT32_ELEMENTS = 2**32  # x with this many elements or more wraps the kernel's uint32 offsets


def applies(x, weight, bias, seq_idx, silu: bool) -> bool:
    """Static shape/dtype facts the kernel needs; anything else runs the reference."""
    dim, width = weight.shape
    kernel_layout = x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES and dim % 8 == 0 and 2 <= width <= 4
    return kernel_layout and x.numel() < UINT32_ELEMENTS


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
    """``seq_idx`` as the contiguous int32 ``[B, T]`` the kernel takes, in storage with ``SEQ_IDX_CHUNK`` more ints
    after it (-1, never read into a stored output), so the forward's read past the last row stays in bounds."""
    flat = seq_idx.to(device=x.device, dtype=torch.int32).reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, SEQ_IDX_CHUNK), value=-1)
    return padded[: flat.numel()].view(seq_idx.shape)


def _kernel_bias(bias: Tensor | None, weight: Tensor) -> Tensor | None:
    return None if bias is None else bias.to(weight.dtype).contiguous()
