"""Host-side validation of a packed batch, once per batch, before it reaches the (compiled) model.

Every check runs here, outside the compiled region, so none of them adds a graph, a guard or a host sync to
the model. ``PackedCollator`` calls :func:`validate` on every batch it emits; :func:`checked` wraps any other
collator (``DataCollatorWithFlattening``, TRL's) the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .boundaries import BOUNDARY_KEYS, Boundaries
from .errors import BoundaryError

IGNORE_INDEX = -100
_FIX_COLLATE = (
    "collate with transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) "
    "or compilepack.PackedCollator"
)


def validate(batch: Mapping) -> Boundaries | None:
    """Check a batch for a patched model; return its :class:`Boundaries`, or None for an unpacked batch.

    Raises :class:`compilepack.BoundaryError` (a ValueError) naming the key, what was expected and the fix,
    for anything that would make a patched model mix documents or drop tokens.
    """
    rows, row_length = _token_shape(batch)
    if not any(batch.get(key) is not None for key in BOUNDARY_KEYS):
        _refuse_unmarked_packing(batch)
        return None
    if batch.get("attention_mask") is not None:
        raise BoundaryError(
            "'attention_mask' was passed together with boundary kwargs ('cu_seq_lens_q', ...): a padding mask "
            "conflicts with the packed layout. Drop 'attention_mask' from packed batches; the boundaries "
            "already say which tokens belong together."
        )
    cu_seqlens = _checked_cu_seqlens(batch, rows * row_length)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    boundaries = Boundaries.from_lengths(lengths, rows=rows, max_seqlen=_checked_max_length(batch, lengths))
    _check_seq_idx(batch, boundaries)
    position_ids = _checked_position_ids(batch, boundaries)
    _check_labels(batch, boundaries)
    return boundaries._replace(position_ids=position_ids)


def checked(collate_fn: Callable) -> Callable:
    """Wrap a collator so every batch it returns is validated on the host (raises on the first bad one)."""

    def collate_and_validate(features, *args, **kwargs):
        batch = collate_fn(features, *args, **kwargs)
        validate(batch)
        return batch

    collate_and_validate.__wrapped__ = collate_fn
    return collate_and_validate


def _token_shape(batch: Mapping) -> tuple[int, int]:
    tokens = batch.get("input_ids")
    if tokens is None:
        embeds = batch.get("inputs_embeds")
        if embeds is None:
            raise BoundaryError("the batch has neither 'input_ids' nor 'inputs_embeds'.")
        tokens = embeds[..., 0]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise BoundaryError(
            f"'input_ids' must be a [rows, tokens] tensor, got {type(tokens).__name__} "
            f"{tuple(getattr(tokens, 'shape', ()))}; {_FIX_COLLATE}."
        )
    if tokens.numel() == 0:
        raise BoundaryError("the batch is empty ('input_ids' has no tokens); skip empty batches in the data loader.")
    return tokens.shape[0], tokens.shape[1]


def _refuse_unmarked_packing(batch: Mapping) -> None:
    """Packed rows without boundary kwargs would run as one long sequence: refuse them."""
    position_ids = batch.get("position_ids")
    if position_ids is None:
        return
    text_positions = position_ids[0] if position_ids.dim() == 3 else position_ids
    restarts = _document_starts(text_positions, step=1)
    restarts[:, 0] = False  # a row start is no restart
    if restarts.any():
        row, column = restarts.nonzero()[0].tolist()
        raise BoundaryError(
            f"'position_ids' restart inside a row (row {row}, token {column}) but the batch carries no "
            f"boundary kwargs ('cu_seq_lens_q', ...): compilepack never infers boundaries from position_ids, so "
            f"these documents would be mixed. Fix: {_FIX_COLLATE}, or wrap the collator with "
            f"compilepack.integrations.with_boundaries (adds them on the host from position_ids)."
        )


def _checked_cu_seqlens(batch: Mapping, total: int) -> torch.Tensor:
    cu_q = batch.get("cu_seq_lens_q")
    if cu_q is None:
        raise BoundaryError(
            "the batch has boundary kwargs but no 'cu_seq_lens_q': seq_idx alone cannot be turned into "
            f"boundaries inside a compiled graph; {_FIX_COLLATE} (return_flash_attn_kwargs=True)."
        )
    cu_q = _checked_cumulative("cu_seq_lens_q", cu_q, total)
    cu_k = batch.get("cu_seq_lens_k")
    if cu_k is not None:
        cu_k = _checked_cumulative("cu_seq_lens_k", cu_k, total)
        if cu_k.shape != cu_q.shape or not torch.equal(cu_k, cu_q):
            raise BoundaryError(
                f"'cu_seq_lens_k' {cu_k.tolist()[:8]}... differs from 'cu_seq_lens_q' {cu_q.tolist()[:8]}...: in a "
                "training batch every document attends to itself, so both must be equal. Pass the same tensor."
            )
    return cu_q


def _checked_cumulative(key: str, cu: torch.Tensor, total: int) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise BoundaryError(f"'{key}' must be a torch.Tensor of int32, got {type(cu).__name__}.")
    if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        raise BoundaryError(f"'{key}' must be an integer tensor (int32), got {cu.dtype}; use .to(torch.int32).")
    if cu.dim() != 1 or cu.numel() < 2:
        raise BoundaryError(f"'{key}' must be 1-D with at least 2 entries [0, ..., T], got shape {tuple(cu.shape)}.")
    cu = cu.to("cpu", torch.int64)
    if cu[0].item() != 0:
        raise BoundaryError(f"'{key}' must start at 0, got {cu[0].item()}: tokens before it would be dropped.")
    steps = cu[1:] - cu[:-1]
    if (steps < 0).any():
        at = int((steps < 0).nonzero()[0])
        raise BoundaryError(
            f"'{key}' must be non-decreasing, but entry {at + 1} ({cu[at + 1].item()}) < entry {at} "
            f"({cu[at].item()}). Build it as a cumulative sum of document lengths."
        )
    if cu[-1].item() != total:
        raise BoundaryError(
            f"'{key}' ends at {cu[-1].item()} but the batch has {total} tokens: these boundaries belong to a "
            "different batch (or were cut). The last entry must equal the token count."
        )
    return cu


def _checked_max_length(batch: Mapping, lengths: list[int]) -> int | None:
    longest = max(lengths)
    found = None
    for key in ("max_length_q", "max_length_k"):
        value = batch.get(key)
        if value is None:
            continue
        if isinstance(value, torch.Tensor) or not isinstance(value, int) or isinstance(value, bool):
            raise BoundaryError(
                f"'{key}' must be a Python int, got {type(value).__name__}: a tensor here would force a host sync "
                "inside the compiled model. Use int(...)."
            )
        if value < longest:
            raise BoundaryError(
                f"'{key}'={value} is smaller than the longest document ({longest} tokens); kernels would read "
                "past it. It must be an upper bound: use the longest length or the row length."
            )
        found = value if found is None else max(found, value)
    return found


def _check_seq_idx(batch: Mapping, boundaries: Boundaries) -> None:
    seq_idx = batch.get("seq_idx")
    if seq_idx is None:
        return
    expected = tuple(boundaries.seq_idx.shape)
    if not isinstance(seq_idx, torch.Tensor) or tuple(seq_idx.shape) != expected:
        raise BoundaryError(
            f"'seq_idx' must have the shape of input_ids {expected}, got {tuple(getattr(seq_idx, 'shape', ()))}."
        )
    if seq_idx.is_floating_point():
        raise BoundaryError(f"'seq_idx' must be an integer tensor (int32), got {seq_idx.dtype}.")
    # seq_idx may number documents differently (the HF collator skips empty ones); what must agree is where
    # a new document starts.
    given, wanted = _document_starts(seq_idx.to("cpu")), _document_starts(boundaries.seq_idx)
    if not torch.equal(given, wanted):
        row, column = (given != wanted).nonzero()[0].tolist()
        raise BoundaryError(
            f"'seq_idx' disagrees with 'cu_seq_lens_q' at row {row}, token {column}: a document "
            f"{'starts' if bool(given[row, column]) else 'does not start'} there in seq_idx but "
            f"{'does' if bool(wanted[row, column]) else 'does not'} in cu_seq_lens_q. Build both from the same lengths."
        )


def _document_starts(ids: torch.Tensor, step: int = 0) -> torch.Tensor:
    """``[rows, T]`` bool: where a document starts, in document ids (``step`` 0: where the id changes) or in
    positions (``step`` 1: where a position does not follow the previous one); every row start counts."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1] + step
    return starts


def _checked_position_ids(batch: Mapping, boundaries: Boundaries) -> torch.Tensor:
    position_ids = batch.get("position_ids")
    if position_ids is None:
        return boundaries.position_ids
    if position_ids.dim() == 3:
        return position_ids  # multimodal RoPE rows: only text-only batches are checked, through the boundaries
    if tuple(position_ids.shape) != tuple(boundaries.position_ids.shape):
        raise BoundaryError(
            f"'position_ids' must have the shape of input_ids {tuple(boundaries.position_ids.shape)}, "
            f"got {tuple(position_ids.shape)}."
        )
    flat = position_ids.to("cpu", torch.int64).flatten()
    cu = boundaries.cu_seqlens.tolist()
    first = flat[0].item()
    expected = boundaries.position_ids.flatten() + first
    if not torch.equal(flat, expected):
        at = int((flat != expected).nonzero()[0])
        doc = int(boundaries.seq_idx.flatten()[at])
        raise BoundaryError(
            f"'position_ids' do not restart at each document: token {at} (document {doc}, tokens "
            f"{cu[doc]}:{cu[doc + 1]}) has position {flat[at].item()}, expected {expected[at].item()}. Positions "
            "must count from the same start inside every document."
        )
    return position_ids


def _check_labels(batch: Mapping, boundaries: Boundaries) -> None:
    labels = batch.get("labels")
    if labels is None:
        return
    if tuple(labels.shape) != tuple(boundaries.seq_idx.shape):
        raise BoundaryError(
            f"'labels' must have the shape of input_ids {tuple(boundaries.seq_idx.shape)}, got {tuple(labels.shape)}."
        )
    row_length = labels.shape[1]
    starts = [s for s in boundaries.cu_seqlens[:-1].tolist() if s % row_length and s < labels.numel()]
    if not starts:
        return
    flat = labels.to("cpu").flatten()
    leaking = [s for s in starts if flat[s].item() != IGNORE_INDEX]
    if leaking:
        raise BoundaryError(
            f"'labels' at document start {leaking[0]} is {flat[leaking[0]].item()}, expected {IGNORE_INDEX}: the "
            "causal-LM loss shifts labels by one, so that label would be predicted from the previous document's "
            f"last token. Set labels to {IGNORE_INDEX} at every document start (as DataCollatorWithFlattening does)."
        )
