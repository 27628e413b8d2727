"""Host-side adapters: boundaries for collators that emit packed rows with ``position_ids`` only
(:func:`with_boundaries`), and moving a batch to the device while its boundaries stay on the host (:func:`to_device`).

``DataCollatorWithFlattening()`` with its defaults, and older TRL padding-free collators, mark documents only by
restarting ``position_ids``. A patched model never reads boundaries off ``position_ids`` (that would be a
data-dependent check inside the graph), so it refuses such a batch rather than run it as one long sequence.
:func:`with_boundaries` adds the HF boundary kwargs on the host, once per batch, and validates the result.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch

from ..boundaries import ATTENTION_MASK, CU_SEQLENS_Q, HOST_BOUNDARY_KEYS, POSITION_IDS
from ..layout import Boundaries
from ..validation import validate


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
    position_ids = batch.get(POSITION_IDS)
    needs_boundaries = (
        batch.get(CU_SEQLENS_Q) is None and position_ids is not None and batch.get(ATTENTION_MASK) is None
    )
    if needs_boundaries:
        # multimodal RoPE positions are [3, rows, T]; their text row restarts like plain positions
        text_positions = position_ids[0] if position_ids.dim() == 3 else position_ids
        boundaries = Boundaries.from_position_ids(text_positions)
        batch.update({k: v for k, v in boundaries.as_kwargs().items() if k != POSITION_IDS})
    validate(batch)
    return batch


def to_device(batch: MutableMapping, device, non_blocking: bool = True) -> dict:
    """``batch`` with its tensors on ``device``, except the boundaries ``cu_seq_lens_q`` / ``cu_seq_lens_k``.

    A patched model moves the boundaries itself, once per forward, and keeps the host copy for kernels that need
    host-side sizes (fla's chunk indices), so none of them copies the boundaries back from the device. Moving them
    with the rest (as HF Trainer does) works too, at the cost of that copy where a kernel needs one.
    """
    return {
        key: value.to(device, non_blocking=non_blocking)
        if isinstance(value, torch.Tensor) and key not in HOST_BOUNDARY_KEYS else value
        for key, value in batch.items()
    }
