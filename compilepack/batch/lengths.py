"""For loops that pack by themselves (verl, OpenRLHF, prime-rl, hand-written): the lengths they already hold, turned
into compilepack's boundary kwargs.

RL frameworks concatenate a micro-batch's sequences into one row and keep its layout as sequence lengths or their
cumulative sums, then hand the model ``position_ids`` alone: stock transformers' linear-attention, Mamba and conv
layers then mix the sequences. :func:`boundary_kwargs` takes that row and the lengths (never its ``position_ids``)
and returns the kwargs a patched model keeps the sequences apart with::

    # verl (use_remove_padding): flash-attn's unpad_input gives the packed row and its cumulative lengths
    input_ids_rmpad, indices, cu_seqlens, *_ = unpad_input(input_ids.unsqueeze(-1), attention_mask)
    batch = boundary_kwargs(input_ids_rmpad.transpose(0, 1), cu_seqlens=cu_seqlens)

    # OpenRLHF (packing_samples): the lengths of the packed sequences
    batch = boundary_kwargs(packed_input_ids, lengths=packed_seq_lens)

    # prime-rl: each micro-batch's seq_lens
    batch = boundary_kwargs(micro_batch.input_ids, lengths=micro_batch.seq_lens)

    logits = compilepack.patch(model)(input_ids=..., **batch).logits   # the returned position_ids replace yours
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ..errors import BoundaryError
from .layout import Boundaries

__all__ = ["boundary_kwargs"]


def boundary_kwargs(input_ids: torch.Tensor, *, lengths: Sequence[int] | torch.Tensor | None = None,
                    cu_seqlens: Sequence[int] | torch.Tensor | None = None) -> dict:
    """The boundary kwargs of a packed row (``cu_seq_lens_q`` / ``_k``, ``max_length_q`` / ``_k``, ``seq_idx``,
    ``position_ids``) from the lengths of its sequences, given one way or the other:

    Args:
        input_ids: ``[1, T]`` (or ``[T]``) the packed tokens; ``[R, T]``: ``R`` rows of ``T`` tokens whose edges are
            sequence edges, the lengths running over the rows in order.
        lengths: each sequence's token count, in order (OpenRLHF's ``packed_seq_lens``, prime-rl's ``seq_lens``); a
            zero is a sequence of no tokens (an unused slot). They must add up to the row's tokens: give padding at
            the end of a row as a sequence of its own (``lengths + [padding]``), so it stays apart.
        cu_seqlens: or their cumulative sums, ``[N+1]`` from 0 (verl's ``cu_seqlens`` from ``unpad_input``, flash-attn's
            varlen layout), ending at the row's tokens.

    Returns:
        A dict for ``model(input_ids=..., **kwargs)`` (host tensors; ``compilepack.to_device`` moves them), the
        positions restarting at every sequence.

    Raises:
        BoundaryError: neither or both of ``lengths`` and ``cu_seqlens``; a negative length, a ``cu_seqlens`` that
            does not start at 0 or steps back; lengths that do not add up to the tokens, or cross a row edge.
    """
    rows, total = _rows_and_tokens(input_ids)
    if (lengths is None) == (cu_seqlens is None):
        raise BoundaryError(
            "boundary_kwargs: pass exactly one of lengths= (each sequence's token count) and cu_seqlens= (their "
            f"cumulative sums from 0), got {'both' if lengths is not None else 'neither'}.")
    lengths = _as_ints("lengths", lengths) if cu_seqlens is None else _lengths_of(_as_ints("cu_seqlens", cu_seqlens))
    if any(n < 0 for n in lengths):
        raise BoundaryError(f"boundary_kwargs: lengths must be >= 0, got {lengths}.")
    if sum(lengths) != total:
        raise BoundaryError(
            f"boundary_kwargs: the sequences' lengths add up to {sum(lengths)} tokens, but input_ids holds {total} "
            f"({rows} x {total // rows}); give every token to a sequence: padding at the end as a sequence of its "
            f"own (lengths + [{total - sum(lengths)}]), never inferred from position_ids.")
    return Boundaries.from_lengths(lengths, rows=rows).as_kwargs()


def _rows_and_tokens(input_ids: torch.Tensor) -> tuple[int, int]:
    shape = tuple(input_ids.shape)
    if len(shape) not in (1, 2) or 0 in shape:
        raise BoundaryError(f"boundary_kwargs: input_ids must be a non-empty [T] or [rows, T] tensor, got {shape}.")
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[0] * shape[1])


def _as_ints(key: str, values) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point():
            raise BoundaryError(f"boundary_kwargs: {key} must be a 1-D integer tensor or a list of ints, got a "
                                f"{values.dim()}-D {values.dtype} tensor.")
        return values.tolist()
    return [int(v) for v in values]


def _lengths_of(cu_seqlens: list[int]) -> list[int]:
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0:
        raise BoundaryError(f"boundary_kwargs: cu_seqlens must start at 0 and hold at least 2 values, got "
                            f"{cu_seqlens[:8]}.")
    lengths = [end - start for start, end in itertools.pairwise(cu_seqlens)]
    if any(n < 0 for n in lengths):
        raise BoundaryError(f"boundary_kwargs: cu_seqlens must never step back, got {cu_seqlens[:8]}.")
    return lengths
