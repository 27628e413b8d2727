"""Collators: :class:`PackedCollator` packs tokenized samples into rows, emitting the HF collator's keys (and,
optionally, fixed shapes); the adapters make other collators' batches meet the contract: boundaries for collators
that emit packed rows with ``position_ids`` only (:func:`with_boundaries`), and moving a batch to the device while
its boundaries stay on the host (:func:`to_device`).

``DataCollatorWithFlattening()`` with its defaults, and older TRL padding-free collators, mark documents only by
restarting ``position_ids``. A patched model never reads boundaries off ``position_ids`` (that would be a
data-dependent check inside the graph), so it refuses such a batch rather than run it as one long sequence.
:func:`with_boundaries` adds the HF boundary kwargs on the host, once per batch, and validates the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence

import torch

from ..errors import BoundaryError
from .keys import ATTENTION_MASK, CU_SEQLENS_Q, HOST_BOUNDARY_KEYS, IGNORE_INDEX, POSITION_IDS
from .layout import Boundaries
from .validation import validate


class PackedCollator:
    """Collate samples into a packed batch for a patched model, usable as HF ``Trainer``'s ``data_collator``.

    Samples are packed into rows of ``max_length`` tokens with best-fit decreasing (longest sample first,
    into the fullest row it still fits). The batch carries the keys of
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``: ``input_ids``,
    ``labels``, ``position_ids``, ``seq_idx``, ``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``. Labels are
    ``IGNORE_INDEX`` at each document start, so the loss never predicts across documents. Every batch is
    validated on the host before it is returned.

    Args:
        max_length: row capacity in tokens. None: one row holding every sample (HF's flattening).
        fixed_shape: every batch has identical tensor shapes and ints, so a plain ``torch.compile(model)``
            compiles once: ``rows`` rows of exactly ``max_length`` tokens (free space becomes a padding
            document with labels ``IGNORE_INDEX``), ``cu_seq_lens_*`` with ``max_docs + 1`` entries (unused
            slots repeat the total: zero-length documents), ``max_length_*`` = ``max_length``.
        rows: rows per batch (fixed-shape mode; required there).
        max_docs: documents per batch in fixed-shape mode, padding documents included (default: 64 per row).
        flatten: emit ``[1, rows * row_length]`` (True, the HF layout) or ``[rows, row_length]``.
        pad_token_id: token id of padding documents.
        separator_id: label at each document start (``-100``, ignored by the loss).
        position_ids_start: first position of every document.

    Raises:
        BoundaryError: a sample longer than ``max_length``, more samples or documents than a fixed-shape batch
            holds, or an empty batch; nothing is ever truncated or dropped silently.
    """

    def __init__(
        self,
        max_length: int | None = None,
        *,
        fixed_shape: bool = False,
        rows: int | None = None,
        max_docs: int | None = None,
        flatten: bool = True,
        pad_token_id: int = 0,
        separator_id: int = IGNORE_INDEX,
        position_ids_start: int = 0,
    ):
        if fixed_shape and (max_length is None or rows is None):
            raise ValueError("PackedCollator(fixed_shape=True) needs max_length= and rows= (the fixed shape).")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}.")
        self.max_length = max_length
        self.fixed_shape = fixed_shape
        self.rows = rows
        self.max_docs = max_docs if max_docs is not None else (64 * rows if fixed_shape else None)
        self.flatten = flatten
        self.pad_token_id = pad_token_id
        self.separator_id = separator_id
        self.position_ids_start = position_ids_start

    def __call__(self, features: Sequence[Mapping], return_tensors: str | None = None) -> dict:
        samples = [self._sample(i, f) for i, f in enumerate(features)]
        samples = [s for s in samples if s[0]]
        if not samples:
            raise BoundaryError("PackedCollator received a batch where every sample is empty.")
        rows = self._pack(samples)
        batch = self._emit(rows)
        validate(batch)
        return batch

    # ------------------------------------------------------------------------------------------ steps

    def _sample(self, index: int, feature: Mapping) -> tuple[list[int], list[int]]:
        input_ids = _as_list(feature["input_ids"])
        labels = _as_list(feature["labels"]) if feature.get("labels") is not None else list(input_ids)
        if len(labels) != len(input_ids):
            raise BoundaryError(f"sample {index}: 'labels' has {len(labels)} entries, 'input_ids' {len(input_ids)}.")
        mask = feature.get("attention_mask")
        if mask is not None and not all(_as_list(mask)):
            raise BoundaryError(
                f"sample {index} is padded (its attention_mask has zeros): PackedCollator packs unpadded samples; "
                "tokenize without padding."
            )
        if self.max_length is not None and len(input_ids) > self.max_length:
            raise BoundaryError(
                f"sample {index} has {len(input_ids)} tokens, more than max_length={self.max_length}; truncate it "
                "when tokenizing (truncation=True, max_length=...) or raise max_length."
            )
        if input_ids:
            labels[0] = self.separator_id
        return input_ids, labels

    def _pack(self, samples: list[tuple[list[int], list[int]]]) -> list[list[tuple[list[int], list[int]]]]:
        """Best-fit decreasing: each sample, longest first, goes into the fullest row that still has room."""
        if self.max_length is None:
            return [samples]
        rows: list[list] = []
        free: list[int] = []
        for sample in sorted(samples, key=lambda s: len(s[0]), reverse=True):
            fitting = [r for r in range(len(rows)) if free[r] >= len(sample[0])]
            if fitting:
                row = min(fitting, key=lambda r: free[r])
            else:
                if self.fixed_shape and len(rows) == self.rows:
                    total = sum(len(s[0]) for s in samples)
                    raise BoundaryError(
                        f"{len(samples)} samples ({total} tokens) do not fit in {self.rows} rows of {self.max_length} "
                        "tokens; lower the batch size or raise rows/max_length."
                    )
                rows.append([])
                free.append(self.max_length)
                row = len(rows) - 1
            rows[row].append(sample)
            free[row] -= len(sample[0])
        return rows

    def _emit(self, rows: list[list[tuple[list[int], list[int]]]]) -> dict:
        if self.fixed_shape:
            rows = rows + [[] for _ in range(self.rows - len(rows))]
            row_length = self.max_length
        elif self.flatten:
            row_length = None  # rows are concatenated as they are
        else:
            row_length = max(sum(len(s[0]) for s in row) for row in rows)
        input_ids, labels, lengths = [], [], []
        for row in rows:
            used = 0
            for ids, row_labels in row:
                input_ids += ids
                labels += row_labels
                lengths.append(len(ids))
                used += len(ids)
            if row_length is not None and row_length > used:
                # free space becomes one padding document: it attends only to itself and is never a target
                input_ids += [self.pad_token_id] * (row_length - used)
                labels += [IGNORE_INDEX] * (row_length - used)
                lengths.append(row_length - used)
        longest = max(lengths)
        if self.fixed_shape:
            lengths = self._fixed_doc_count(lengths)
        layout_rows = 1 if (self.flatten or row_length is None) else len(rows)
        boundaries = Boundaries.from_lengths(
            lengths,
            rows=layout_rows,
            max_seqlen=self.max_length if self.fixed_shape else longest,
            position_start=self.position_ids_start,
        )
        shape = boundaries.seq_idx.shape
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long).view(shape),
            "labels": torch.tensor(labels, dtype=torch.long).view(shape),
            **boundaries.as_kwargs(),
        }

    def _fixed_doc_count(self, lengths: list[int]) -> list[int]:
        if len(lengths) > self.max_docs:
            raise BoundaryError(
                f"the batch has {len(lengths)} documents (padding included), more than max_docs={self.max_docs}; "
                "raise max_docs or lower the batch size."
            )
        return lengths + [0] * (self.max_docs - len(lengths))


def _as_list(values) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


# ------------------------------------------------------------------------------------ adapters for other collators

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
