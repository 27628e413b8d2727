"""Boundaries: the layout of one packed batch (documents in rows), built and checked on the host.

``Boundaries.from_lengths`` lays documents out in rows; ``Boundaries.from_position_ids`` reads them off restarting
position ids (for data loaders only: a patched model never does); ``compilepack.validate(batch)`` returns the
boundaries of a collated batch. Nothing here runs inside a compiled model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import rules
from .keys import CU_SEQLENS_K, CU_SEQLENS_Q, MAX_LENGTH_K, MAX_LENGTH_Q, POSITION_IDS, SEQ_IDX
from .derived import document_starts, positions_in_documents, seq_idx_from_cu_seqlens
from ..errors import BoundaryError


class Boundaries(NamedTuple):
    """Boundaries of one packed batch, on the host.

    Attributes:
        cu_seqlens: ``int32 [N+1]`` cumulative document lengths over the flattened tokens; zero-length
            documents (repeated values) are allowed.
        max_seqlen: the longest document, or any larger bound (fixed-shape batches use the row length).
        seq_idx: ``int32 [rows, row_length]`` document index of every token.
        position_ids: ``int64 [rows, row_length]`` position of every token inside its document.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_idx: torch.Tensor
    position_ids: torch.Tensor

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int], rows: int = 1, max_seqlen: int | None = None, position_start: int = 0
    ) -> Boundaries:
        """Boundaries of documents of these lengths laid out in ``rows`` equal rows.

        Raises BoundaryError when a length is negative, the tokens do not split into ``rows`` equal rows,
        or a document would cross a row edge.
        """
        lengths = [int(n) for n in lengths]
        if not lengths or any(n < 0 for n in lengths):
            raise BoundaryError(f"document lengths must be a non-empty list of ints >= 0, got {lengths}.")
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        total = cu[-1]
        if total == 0 or total % rows:
            raise BoundaryError(
                f"{total} tokens cannot be laid out in {rows} equal rows; pad the last document of each row."
            )
        row_length = total // rows
        rules.check_row_edges_on_host(cu, rows, row_length)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32)
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, total)
        positions = positions_in_documents(cu_seqlens, seq_idx) + position_start
        longest = max(lengths)
        if max_seqlen is not None and max_seqlen < longest:
            raise BoundaryError(f"max_seqlen={max_seqlen} is smaller than the longest document ({longest}).")
        return cls(
            cu_seqlens=cu_seqlens,
            max_seqlen=longest if max_seqlen is None else int(max_seqlen),
            seq_idx=seq_idx.view(rows, row_length),
            position_ids=positions.view(rows, row_length),
        )

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> Boundaries:
        """Boundaries implied by position ids that restart at each document (host-side, for data loaders).

        A document starts at the start of every row and wherever a position is not the previous one plus
        one. Use this to give boundaries to batches from collators that emit only ``position_ids``; a
        patched model never does this itself.
        """
        positions = torch.as_tensor(position_ids)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        if positions.dim() != 2 or positions.numel() == 0:
            raise BoundaryError(f"position_ids must be a non-empty [rows, T] tensor, got {tuple(positions.shape)}.")
        positions = positions.to("cpu", torch.int64)
        starts = document_starts(positions, step=1)
        flat_starts = starts.flatten().nonzero().flatten().tolist()
        lengths = [e - s for s, e in zip(flat_starts, [*flat_starts[1:], positions.numel()])]
        boundaries = cls.from_lengths(lengths, rows=positions.shape[0])
        return boundaries._replace(position_ids=positions)

    @property
    def lengths(self) -> list[int]:
        cu = self.cu_seqlens.tolist()
        return [e - s for s, e in zip(cu[:-1], cu[1:])]

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def as_kwargs(self) -> dict:
        """The HF collator's keys for these boundaries, ready for ``model(**batch)``: as the HF collator, two equal
        tensors for ``cu_seq_lens_q`` and ``_k`` (one object in both would make a compiled model that also sees the
        HF collator's batches compile again: dynamo guards on inputs' identity)."""
        return {
            CU_SEQLENS_Q: self.cu_seqlens,
            CU_SEQLENS_K: self.cu_seqlens.clone(),
            MAX_LENGTH_Q: self.max_seqlen,
            MAX_LENGTH_K: self.max_seqlen,
            SEQ_IDX: self.seq_idx,
            POSITION_IDS: self.position_ids,
        }
