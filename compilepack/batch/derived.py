"""What a patched model derives from ``cu_seqlens`` inside its graph: document starts, ``seq_idx`` and positions.

Traceable: no host read, no data-dependent shape, so they run inside a compiled forward (the patched decoder) and in
the ops' references alike.
"""

from __future__ import annotations

import torch


def document_starts(ids: torch.Tensor, step: int = 0) -> torch.Tensor:
    """``[rows, T]`` bool: where a document starts, given document ids (``step`` 0: where the id changes) or
    positions (``step`` 1: where a position does not follow the previous one). Every row start counts. Traceable:
    no host read."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1] + step
    return starts


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of every token, ``int32 [total]``, from ``cu_seqlens`` ``[N+1]``: document ``i`` holds tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]``.

    One ``searchsorted``. Zero-length documents (the fixed-shape collator's unused slots) take no tokens, so their
    indices never appear: the numbering counts them, as ``Boundaries.from_lengths`` and the HF collator do.
    """
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # Search the whole tensor (size N+1 >= 2), not cu_seqlens[1:]: a size-1 slice for a one-document batch
    # would be specialised by the compiler and cost a recompile.
    return (torch.searchsorted(cu_seqlens, positions, right=True) - 1).to(torch.int32)


def positions_in_documents(cu_seqlens: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    """``int64`` position of every token inside its document (``seq_idx``: flat, from :func:`seq_idx_from_cu_seqlens`)."""
    positions = torch.arange(seq_idx.numel(), device=seq_idx.device)
    return positions - cu_seqlens.to(torch.int64)[seq_idx.to(torch.int64)]
