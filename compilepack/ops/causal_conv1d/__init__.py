"""``compilepack::causal_conv1d_varlen``: depthwise causal conv1d that never reads across a document start.

The op takes the layout transformers passes to ``causal_conv1d_fn`` (``x [B, D, T]``, the transpose of a
``[B, T, D]`` projection) and returns the same channel-last layout: ``out`` is the transpose of a contiguous
``[B, T, D]`` tensor (strides ``(T*D, 1, D)``) on every path, which is what the causal-conv1d kernel returns for
channel-last input (``torch.empty_like(x)``) and what the caller's ``out.transpose(1, 2)`` wants. The gradient of x
is laid out like ``torch.empty_like(x)``: channel-last for the channel-last x transformers passes.

- ``reference.py``: pure torch (any device; what runs on CPU), explicit backward: every tap multiplied by its
  same-document 0/1 factor before it is summed (no host sync), or on CPU for large inputs a blind depthwise conv2d
  with the rows next to document edges recomputed; both exact, documents isolated to the bit;
- ``causal_conv1d_kernel.py``: the causal-conv1d CUDA kernels (``backend="causal_conv1d"``);
- ``naive.py``: one ``F.conv1d`` per document, the tests' oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import backends
from .._scaffold import define_op
from . import causal_conv1d_kernel, reference
from .naive import causal_conv1d_naive

__all__ = ["causal_conv1d_naive", "causal_conv1d_varlen"]

ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    seq_idx: Tensor,
    activation: str | None = None,
    *,
    backend: str = backends.REFERENCE,
) -> Tensor:
    """Depthwise causal conv1d over packed rows: no tap reaches across a document start.

    Args:
        x: ``[B, D, T]`` float, any strides; transformers passes the transpose of a contiguous ``[B, T, D]``
            (channel-last), which is also the layout the CUDA kernel needs (other layouts are copied there).
        weight: ``[D, W]`` (transformers passes ``conv1d.weight.squeeze(1)``).
        bias: ``[D]`` or None.
        seq_idx: ``[B, T]`` integer (int32 from the HF collator), the document index of every token,
            non-decreasing along a row; a document starts where it changes and at the first token of each
            row, so rows are independent and ids may be global across rows. Moved to x's device if needed.
        activation: None, ``"silu"`` or ``"swish"`` (the same function), fused into forward and backward.
        backend: the CUDA library used when x is on CUDA (``"causal_conv1d"``) or ``"reference"``.

    Returns:
        ``[B, D, T]`` in x's dtype, channel-last: the transpose of a contiguous ``[B, T, D]``.
        Computed in float32 (float64 for float64 inputs), as the CUDA kernel accumulates.
    """
    _check_arguments(x, weight, bias, seq_idx, activation)
    out, _ = OP(x, weight, bias, seq_idx, activation is not None, backend)
    return out


def _check_arguments(x, weight, bias, seq_idx, activation) -> None:
    """Shape and dtype checks only (no tensor data), so they trace without a graph break."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a float [B, D, T] tensor, got {x.dim()}-D {x.dtype} of shape {tuple(x.shape)}.")
    batch, dim, seqlen = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a float [D, W] tensor with D={dim} (x.shape[1]); got {weight.dtype} of shape "
            f"{tuple(weight.shape)}. Pass conv1d.weight.squeeze(1)."
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != dim or not bias.is_floating_point()):
        raise ValueError(f"bias must be None or a float [D] tensor with D={dim}; got {bias.dtype} {tuple(bias.shape)}.")
    if seq_idx.dim() != 2 or seq_idx.shape[0] != batch or seq_idx.shape[1] != seqlen:
        raise ValueError(
            f"seq_idx must have shape [B, T] = {(batch, seqlen)} (x.shape[0], x.shape[2]); got {tuple(seq_idx.shape)}."
        )
    if seq_idx.is_floating_point() or seq_idx.is_complex() or seq_idx.dtype == torch.bool:
        raise ValueError(f"seq_idx must be an integer tensor (int32 as the HF collator emits it), got {seq_idx.dtype}.")


def _signature(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor, silu: bool, backend: str): ...


OP = define_op(
    "compilepack::causal_conv1d_varlen",
    signature=_signature,
    differentiable=("x", "weight", "bias"),
    reference=reference.PATH,
    kernels={"causal_conv1d": causal_conv1d_kernel.PATH},
    kernel_applies=causal_conv1d_kernel.applies,
    boundaries=("seq_idx",),
    kind="conv",
)
