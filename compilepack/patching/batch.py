"""Once per forward, at the top of the patched decoder: turn the collator's boundary kwargs into device tensors.

The layers below receive the same keys the HF collator emits (``cu_seq_lens_q``, ``max_length_q``,
``seq_idx``...), already on the model's device, so no layer moves or derives anything itself. This code is
traced by dynamo: inside a graph it branches only on static facts (which keys are present, devices), never on
tensor values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..boundaries import BOUNDARY_KEYS
from ..errors import BoundaryError
from ..ops._common import seq_idx_from_cu_seqlens


def packed_decoder_forward(stock_forward: Callable, parameter_names: tuple[str, ...]) -> Callable:
    """A decoder ``forward`` that prepares packed kwargs, then runs the (rebound) stock forward."""

    def forward(self, *args, **kwargs):
        kwargs.update(zip(parameter_names, args))  # transformers passes keywords; positional ones are named here
        if any(kwargs.get(key) is not None for key in BOUNDARY_KEYS):
            kwargs = prepare_packed_kwargs(kwargs)
        elif kwargs.get("attention_mask") is None and not _has_cache(kwargs):
            _refuse_unmarked_packing(kwargs.get("position_ids"))
        return stock_forward(self, **kwargs)

    forward.__compilepack__ = True
    return forward


def prepare_packed_kwargs(kwargs: dict) -> dict:
    """Boundary kwargs on the tokens' device, with ``seq_idx`` and missing ``position_ids`` derived.

    ``cu_seq_lens_q`` is the single source of truth: ``seq_idx`` is recomputed from it (one searchsorted)
    so the attention and the mixers can never disagree about where a document starts.
    """
    _refuse_conflicting_inputs(kwargs)
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs["inputs_embeds"]
    rows, row_length = tokens.shape[0], tokens.shape[1]
    given = kwargs["cu_seq_lens_q"]
    cu_seqlens = given.to(device=tokens.device, dtype=torch.int32, non_blocking=True)
    seq_idx_flat = seq_idx_from_cu_seqlens(cu_seqlens, rows * row_length)
    max_seqlen = kwargs.get("max_length_q")
    if max_seqlen is None:
        max_seqlen = row_length  # documents never cross rows, so the row length bounds every document
    kwargs.update(
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=max_seqlen,
        max_length_k=max_seqlen,
        seq_idx=seq_idx_flat.view(rows, row_length),
        # the host copy, when the batch brought one (kernels that need host-side sizes read it instead of
        # copying cu_seqlens back from the device); None when a trainer already moved the batch to the device
        cu_seq_lens_q_cpu=given.to(torch.int32) if given.device.type == "cpu" else None,
        # a packed row has no meaningful cache: several documents would write one state
        use_cache=False,
    )
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = _positions_in_documents(cu_seqlens, seq_idx_flat).view(rows, row_length)
    return kwargs


UNMARKED_PACKING = (
    "position_ids restart inside a row but the batch carries no boundary kwargs (cu_seq_lens_q, ...): a patched "
    "model never infers documents from position_ids and would run the row as one sequence, mixing documents. "
    "Collate with DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) or "
    "compilepack.PackedCollator, or wrap the collator with compilepack.integrations.with_boundaries."
)


def _refuse_unmarked_packing(position_ids) -> None:
    """Refuse packed rows that carry no boundaries: a batch without boundary kwargs runs every row as one
    sequence, so position_ids that restart inside a row mean the boundaries were dropped.

    Eager on the CPU the check runs on the host and raises :class:`compilepack.BoundaryError`. Inside a compiled
    graph, or on an accelerator, reading the positions would be a host sync: there it is an asynchronous device
    assert (``torch._assert_async``), which fails the step with a ``RuntimeError`` carrying the same message (on
    CUDA at the next synchronisation). Multimodal (3-D) position ids may legitimately jump and are not checked."""
    if position_ids is None or position_ids.dim() != 2:
        return
    restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if position_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        if restarts.any():
            raise BoundaryError(UNMARKED_PACKING)
        return
    torch._assert_async(~restarts.any(), UNMARKED_PACKING)


def _has_cache(kwargs: dict) -> bool:
    return kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None


def _positions_in_documents(cu_seqlens: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(seq_idx.numel(), device=seq_idx.device)
    return positions - cu_seqlens.long()[seq_idx.long()]


def _refuse_conflicting_inputs(kwargs: dict) -> None:
    if kwargs.get("cu_seq_lens_q") is None:
        raise BoundaryError(
            "the batch has boundary kwargs but no 'cu_seq_lens_q' (seq_idx alone cannot be turned into boundaries "
            "inside a compiled graph). Collate with DataCollatorWithFlattening(return_flash_attn_kwargs=True, "
            "return_seq_idx=True) or compilepack.PackedCollator."
        )
    if kwargs.get("attention_mask") is not None:
        raise BoundaryError(
            "'attention_mask' was passed together with boundary kwargs: a padding mask conflicts with the packed "
            "layout. Drop 'attention_mask' from packed batches."
        )
    if _has_cache(kwargs):
        raise BoundaryError(
            "a cache was passed with a packed batch: packed rows hold several documents and cannot continue a "
            "cache. Run packed batches without 'cache'/'past_key_values' (generation works on unpacked inputs)."
        )
