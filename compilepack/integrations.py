"""Host-side adapters for collators that emit packed rows with ``position_ids`` only.

``DataCollatorWithFlattening()`` with its defaults, and older TRL padding-free collators, mark documents only by
restarting ``position_ids``. A patched model never reads boundaries off ``position_ids`` (that would be a
data-dependent check inside the graph), so such a batch would run as one long sequence. :func:`with_boundaries`
adds the HF boundary kwargs on the host, once per batch, and validates the result.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

from .boundaries import Boundaries
from .validation import validate


def with_boundaries(collate_fn: Callable) -> Callable:
    """Wrap a collator so every batch it returns carries validated boundary kwargs.

    Batches that already carry ``cu_seq_lens_q`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``,
    TRL's ``padding_free=True`` collator (1.16, tested), ``PackedCollator``) and padded batches (with an
    ``attention_mask``) pass through unchanged; the others get ``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``
    and ``seq_idx`` from :meth:`Boundaries.from_position_ids`. Every batch is then checked with
    :func:`compilepack.validate`, which raises :class:`compilepack.BoundaryError` on the first bad one.

    Example::

        collate = with_boundaries(DataCollatorWithFlattening())   # position_ids only -> + cu_seq_lens_q, seq_idx, ...
        trainer = Trainer(model=compilepack.patch(model), data_collator=collate, ...)
    """

    def collate_with_boundaries(features, *args, **kwargs):
        return add_boundaries(collate_fn(features, *args, **kwargs))

    collate_with_boundaries.__wrapped__ = collate_fn
    return collate_with_boundaries


def add_boundaries(batch: MutableMapping) -> MutableMapping:
    """Add the boundary kwargs a packed ``batch`` lacks (from its ``position_ids``), validate it, and return it."""
    position_ids = batch.get("position_ids")
    needs_boundaries = (
        batch.get("cu_seq_lens_q") is None and position_ids is not None and batch.get("attention_mask") is None
    )
    if needs_boundaries:
        # multimodal RoPE positions are [3, rows, T]; their text row restarts like plain positions
        text_positions = position_ids[0] if position_ids.dim() == 3 else position_ids
        boundaries = Boundaries.from_position_ids(text_positions)
        batch.update({k: v for k, v in boundaries.as_kwargs().items() if k != "position_ids"})
    validate(batch)
    return batch
