"""Host-side validation of a packed batch, once per batch, before it reaches the (compiled) model.

Every check runs here, outside the compiled region, so none of them adds a graph, a guard or a host sync to
the model. ``PackedCollator`` calls :func:`validate` on every batch it emits; :func:`checked` wraps any other
collator (``DataCollatorWithFlattening``, TRL's) the same way. The rules and their messages are
:mod:`.rules`' (the patched model checks the same boundary rules on every call); validation adds the
two that only a data pipeline can own: position ids restarting per document, and labels at document starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from . import rules
from .keys import FIX_COLLATE, IGNORE_INDEX, LABELS, MAX_LENGTH_KEYS, POSITION_IDS
from .layout import Boundaries
from ..errors import BoundaryError


def validate(batch: Mapping) -> Boundaries | None:
    """Check a batch for a patched model; return its :class:`Boundaries`, or None for an unpacked batch.

    Raises :class:`compilepack.BoundaryError` (a ValueError) naming the key, what was expected, what was found
    and the fix, for anything that would make a patched model mix documents or drop tokens. Labels must be -100
    at every document start: the model cannot tell a label it should not train on, so this check is the data
    pipeline's (``PackedCollator`` and ``checked`` run it; a batch handed straight to the model skips it).
    """
    tokens = _tokens(batch)
    rows, row_length = tokens.shape[0], tokens.shape[1]
    if not rules.has_boundaries(batch):
        _refuse_unmarked_packing(batch)
        return None
    rules.check_static(batch, tokens)
    cu = rules.check_values_on_host(batch, rows, row_length)
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    bounds = [int(batch[key]) for key in MAX_LENGTH_KEYS if batch.get(key) is not None]
    boundaries = Boundaries.from_lengths(lengths, rows=rows, max_seqlen=max(bounds) if bounds else None)
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


def _tokens(batch: Mapping) -> torch.Tensor:
    tokens = batch.get("input_ids")
    if tokens is None:
        embeds = batch.get("inputs_embeds")
        if embeds is None:
            raise BoundaryError("the batch has neither 'input_ids' nor 'inputs_embeds'.")
        tokens = embeds[..., 0]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise BoundaryError(
            f"'input_ids' must be a [rows, tokens] tensor, got {type(tokens).__name__} "
            f"{tuple(getattr(tokens, 'shape', ()))}; {FIX_COLLATE}."
        )
    if tokens.numel() == 0:
        raise BoundaryError("the batch is empty ('input_ids' has no tokens); skip empty batches in the data loader.")
    return tokens


def _refuse_unmarked_packing(batch: Mapping) -> None:
    """Packed rows without boundary kwargs would run as one long sequence: refuse them."""
    position_ids = batch.get(POSITION_IDS)
    if position_ids is not None:
        rules.refuse_unmarked_packing(position_ids[0] if position_ids.dim() == 3 else position_ids)


def _checked_position_ids(batch: Mapping, boundaries: Boundaries) -> torch.Tensor:
    position_ids = batch.get(POSITION_IDS)
    if position_ids is None:
        return boundaries.position_ids
    if position_ids.dim() == 3:
        return position_ids  # multimodal RoPE rows: only text-only batches are checked, through the boundaries
    expected_shape = tuple(boundaries.position_ids.shape)
    if tuple(position_ids.shape) != expected_shape:
        raise _shaped_like_tokens(POSITION_IDS, expected_shape, position_ids)
    flat = position_ids.to("cpu", torch.int64).flatten()
    expected = boundaries.position_ids.flatten() + flat[0].item()
    if not torch.equal(flat, expected):
        at = int((flat != expected).nonzero()[0])
        doc = int(boundaries.seq_idx.flatten()[at])
        cu = boundaries.cu_seqlens.tolist()
        raise rules.POSITIONS_RESTART.refuse(
            f"position {flat[at].item()} at token {at} (document {doc}, tokens {cu[doc]}:{cu[doc + 1]}), "
            f"where {expected[at].item()} was expected"
        )
    return position_ids


def _check_labels(batch: Mapping, boundaries: Boundaries) -> None:
    labels = batch.get(LABELS)
    if labels is None:
        return
    expected_shape = tuple(boundaries.seq_idx.shape)
    if tuple(labels.shape) != expected_shape:
        raise _shaped_like_tokens(LABELS, expected_shape, labels)
    row_length = labels.shape[1]
    # a row start needs no -100: nothing before it in the row
    starts = [s for s in boundaries.cu_seqlens[:-1].tolist() if s % row_length and s < labels.numel()]
    flat = labels.to("cpu").flatten()
    leaking = [s for s in starts if flat[s].item() != IGNORE_INDEX]
    if leaking:
        raise rules.LABELS_AT_STARTS.refuse(f"{flat[leaking[0]].item()} at the document start at token {leaking[0]}")


def _shaped_like_tokens(key: str, expected_shape: tuple, value: torch.Tensor) -> BoundaryError:
    rule = rules.SHAPED_LIKE_TOKENS._replace(key=key, expected=f"the shape of input_ids {expected_shape}")
    return rule.refuse(str(tuple(value.shape)))

