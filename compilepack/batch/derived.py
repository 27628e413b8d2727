"""What a patched model derives from ``cu_seqlens`` inside its graph: document starts, ``seq_idx``, positions, and
the typed value its layers read (:class:`PackedBoundaries`).

Traceable: no host read, no data-dependent shape, so they run inside a compiled forward (the patched decoder) and in
the ops' references alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class PackedBoundaries(NamedTuple):
    """A packed batch's boundaries as every patched layer reads them: built once per forward by the patched decoder
    and carried down under one private key (``keys.PACKED_BOUNDARIES``), beside the HF keys that stock code reads.
    Tensors, ints and a Python object: dynamo traces it as it traces the loose keys, with no break and no new guard.

    Attributes:
        cu_seqlens: ``int32 [N+1]`` document boundaries over the flattened rows, on the tokens' device.
        cu_seqlens_cpu: the same on the host when the batch brought them there (kernels that need host-side sizes
            read it instead of copying ``cu_seqlens`` back from the device), else None.
        max_seqlen: a bound on document length: the batch's ``max_length_q``, or the row length.
        seq_idx: ``int32 [R, T]`` document index of every token, on the device (of the whole rows under context
            parallelism).
        shard: the context-parallel group the batch was sharded for (its ``context_parallel_shard``), or None.
    """

    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    max_seqlen: int | None
    seq_idx: torch.Tensor
    shard: Any = None

    @classmethod
    def of_seq_idx(cls, seq_idx: torch.Tensor) -> PackedBoundaries:
        """Boundaries known only by ``seq_idx``: what a kernel call receives that is handed ``seq_idx`` but not the
        forward's ``**kwargs`` (LFM2's conv in transformers 5.18), all that the conv and scan ops read."""
        return cls(None, None, None, seq_idx)


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
    """``int64`` position of every token inside its document.

    ``seq_idx``: flat, from :func:`seq_idx_from_cu_seqlens`."""
    positions = torch.arange(seq_idx.numel(), device=seq_idx.device)
    return positions - cu_seqlens.to(torch.int64)[seq_idx.to(torch.int64)]
