"""Glue shared by the ops that call flash-linear-attention (gated delta rule, Kimi delta attention).

fla >= 0.6 (read in fla-core 0.6.0): its varlen mode wants one packed row, launches kernels on the current CUDA
device, and builds chunk indices from the boundaries; from device ``cu_seqlens`` alone that is a device-to-host
copy per call, so the host copy the patch carries from the collator (``cu_seqlens_cpu``) is handed over too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


def flat_row(x: Tensor) -> Tensor:
    """``[B, T, ...]`` -> ``[1, B*T, ...]`` contiguous: fla's varlen mode wants one packed row."""
    return x.reshape(1, -1, *x.shape[2:]).contiguous()


def kernel_device(x: Tensor):
    """fla launches kernels on the current device; make it the tensors' device (as fla's ``input_guard`` does)."""
    return torch.cuda.device(x.device.index) if x.is_cuda else contextlib.nullcontext()


def chunk_indices(fla, cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None, chunk_size: int) -> Tensor:
    """fla's ``[n_chunks, 2]`` chunk indices; read from the host copy of the boundaries when there is one."""
    return fla.prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
