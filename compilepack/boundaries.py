"""The boundaries of a packed batch: where each document starts and ends.

A packed batch is the HF collator's format: tokens of several documents concatenated in one row (``[1, T]``), or
in ``R`` rows whose edges are also document edges, with the boundaries passed alongside as

- ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``int32 [N+1]`` cumulative document lengths over the flattened tokens,
- ``max_length_q`` / ``max_length_k``: Python int, the longest document (any upper bound works),
- ``seq_idx``: ``int32 [R, T]`` document index of every token,
- ``position_ids``: ``int64 [R, T]`` position inside the document (restarting at each document).

:class:`Boundaries` builds these on the host, from document lengths or (for data loaders only) from restarting
position ids; ``compilepack.validate(batch)`` checks a collated batch and returns its :class:`Boundaries`. Nothing
here runs inside a compiled model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .errors import BoundaryError

# The boundary kwargs, as DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) names them.
CU_SEQLENS_Q, CU_SEQLENS_K = "cu_seq_lens_q", "cu_seq_lens_k"
MAX_LENGTH_Q, MAX_LENGTH_K = "max_length_q", "max_length_k"
SEQ_IDX = "seq_idx"
CU_SEQLENS_KEYS = (CU_SEQLENS_Q, CU_SEQLENS_K)
MAX_LENGTH_KEYS = (MAX_LENGTH_Q, MAX_LENGTH_K)
BOUNDARY_KEYS = (*CU_SEQLENS_KEYS, *MAX_LENGTH_KEYS, SEQ_IDX)
# Other keys of a batch the contract speaks about.
POSITION_IDS, ATTENTION_MASK, LABELS = "position_ids", "attention_mask", "labels"
# Internal: the host copy of cu_seq_lens_q that the patched decoder hands to the layers (kernels that need host-side
# sizes read it instead of copying the device tensor back). Never part of a user's batch.
HOST_CU_SEQLENS = "cu_seq_lens_q_cpu"
# The keys a patched model moves to the device itself (compilepack.to_device leaves them on the host).
HOST_BOUNDARY_KEYS = CU_SEQLENS_KEYS

FIX_COLLATE = (
    "collate with transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) "
    "or compilepack.PackedCollator"
)


def document_starts(ids: torch.Tensor, step: int = 0) -> torch.Tensor:
    """``[rows, T]`` bool: where a document starts, given document ids (``step`` 0: where the id changes) or
    positions (``step`` 1: where a position does not follow the previous one). Every row start counts. Traceable:
    no host read."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1] + step
    return starts


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
        from .guards import check_row_edges_on_host  # guards builds on these keys: imported here, not at the top

        check_row_edges_on_host(cu, rows, row_length)
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
        starts = torch.tensor(cu[:-1], dtype=torch.int64)
        positions = torch.arange(total) - torch.repeat_interleave(starts, torch.tensor(lengths)) + position_start
        longest = max(lengths)
        if max_seqlen is not None and max_seqlen < longest:
            raise BoundaryError(f"max_seqlen={max_seqlen} is smaller than the longest document ({longest}).")
        return cls(
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
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
        """The HF collator's keys for these boundaries, ready for ``model(**batch)``."""
        return {
            CU_SEQLENS_Q: self.cu_seqlens,
            CU_SEQLENS_K: self.cu_seqlens,
            MAX_LENGTH_Q: self.max_seqlen,
            MAX_LENGTH_K: self.max_seqlen,
            SEQ_IDX: self.seq_idx,
            POSITION_IDS: self.position_ids,
        }
