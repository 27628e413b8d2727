"""Small helpers shared by the ops: boundary conversions that are safe inside a compiled graph."""

from __future__ import annotations

import torch


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of every token, ``int32 [total]``, from ``cu_seqlens`` ``[N+1]``.

    Traced as one ``searchsorted`` (no host sync, no data-dependent shape). Zero-length documents (the
    fixed-shape collator's unused slots) take no tokens, so they never appear in the result.
    """
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # Search the whole tensor (size N+1 >= 2), not cu_seqlens[1:]: a size-1 slice for a one-document batch
    # would be specialised by the compiler and cost a recompile.
    return (torch.searchsorted(cu_seqlens, positions, right=True) - 1).to(torch.int32)


def host_boundaries(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as Python ints, for reference ops that loop over documents.

    Only called inside custom-op bodies, which the compiler treats as opaque: the conversion never
    becomes a graph break. On CPU it is free; a CUDA reference path pays one sync here.
    """
    return cu_seqlens.tolist()
