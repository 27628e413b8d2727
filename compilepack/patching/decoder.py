"""Once per forward, at the top of the patched decoder: check the batch's boundaries and turn them into device
tensors, or hand a batch without boundaries to the stock forward.

The layers below receive the boundaries once, as one typed value (:class:`~compilepack.batch.derived.PackedBoundaries`
under ``keys.PACKED_BOUNDARIES``: what compilepack's replacements read), and the keys the HF collator emits
(``cu_seq_lens_q``, ``max_length_q``, ``seq_idx``...: what stock code reads), both already on the model's device, so
no layer moves or derives anything itself. This code is
traced by dynamo: inside a graph it branches only on static facts (which keys are present, types, devices),
never on tensor values; the value rules become asynchronous device asserts there (:mod:`compilepack.batch.rules`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..batch import rules
from ..batch.keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    INPUTS_EMBEDS,
    CU_SEQLENS_K,
    CU_SEQLENS_Q,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    PACKED_BOUNDARIES,
    POSITION_IDS,
    SEQ_IDX,
    SHARD_KEY,
)
from ..batch.derived import PackedBoundaries, positions_in_documents, seq_idx_from_cu_seqlens
from ..distributed.sharding import check_batch, shards_per_row
from ..errors import ContextParallelError


def packed_decoder_forward(
    packed_forward: Callable, stock_forward: Callable, parameter_names: tuple[str, ...], *,
    stock_packs_positions: bool = False, cp_group=None,
) -> Callable:
    """A decoder ``forward``: a batch with boundary kwargs is checked, prepared and run by ``packed_forward`` (the
    stock forward rebound to compilepack's mask creators); any other batch runs ``stock_forward`` exactly.

    ``stock_packs_positions``: the stock forward keeps documents of a position_ids-only packed row apart by itself
    (attention-only families, when it builds no cache): such rows run stock. Otherwise they are refused, since the
    stock forward would mix their documents. ``cp_group``: the model's context-parallel group
    (``patch(..., context_parallel=)``), or None.
    """

    @functools.wraps(stock_forward)  # the stock signature, for inspect.signature, Trainer and PEFT
    def forward(self, *args, **kwargs):
        kwargs.update(zip(parameter_names, args))  # transformers passes keywords; positional ones are named here
        if rules.has_boundaries(kwargs):
            return packed_forward(self, **prepare_packed_kwargs(kwargs, cp_group))
        if not (stock_packs_positions and not _builds_cache(self, kwargs)):
            _refuse_unmarked_packing(kwargs)
        return stock_forward(self, **kwargs)

    return forward


def prepare_packed_kwargs(kwargs: dict, cp_group=None) -> dict:
    """Boundary kwargs checked and on the tokens' device, with ``seq_idx`` and missing ``position_ids`` derived, and
    the same boundaries as one :class:`PackedBoundaries` for compilepack's replacements.

    ``cu_seq_lens_q`` is the single source of truth: ``seq_idx`` is recomputed from it (one searchsorted)
    so the attention and the mixers can never disagree about where a document starts.
    """
    tokens = kwargs.get(INPUT_IDS)
    if tokens is None:
        tokens = kwargs[INPUTS_EMBEDS]
    rows, row_length = tokens.shape[0], tokens.shape[1]
    if cp_group is None:
        _refuse_shard(kwargs)
    else:  # a shard holds 1/W of every row; its boundaries (cu_seq_lens_q, seq_idx) describe whole rows
        check_batch(kwargs.get(SHARD_KEY), cp_group, "the packed decoder")
        row_length *= shards_per_row(kwargs, tokens)
    rules.check_static(kwargs, tokens, row_length)
    given = kwargs[CU_SEQLENS_Q]
    on_host = given.device.type == "cpu" and not torch.compiler.is_compiling()
    if on_host:
        rules.check_values_on_host(kwargs, rows, row_length)
    cu_seqlens = given.to(device=tokens.device, dtype=torch.int32, non_blocking=True)
    seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, rows * row_length).view(rows, row_length)
    if not on_host:
        rules.assert_values_in_graph(kwargs, cu_seqlens, seq_idx)
    elif kwargs.get(SEQ_IDX) is not None and kwargs[SEQ_IDX].device.type != "cpu":
        rules.assert_seq_idx_in_graph(kwargs[SEQ_IDX], seq_idx)
    max_seqlen = _max_seqlen(kwargs.get(MAX_LENGTH_Q), row_length, on_host)
    boundaries = PackedBoundaries(
        cu_seqlens, _host_copy(given, kwargs.get(PACKED_BOUNDARIES)), max_seqlen, seq_idx, kwargs.get(SHARD_KEY),
    )
    kwargs.update({
        CU_SEQLENS_Q: cu_seqlens,
        CU_SEQLENS_K: cu_seqlens,
        MAX_LENGTH_Q: max_seqlen,
        MAX_LENGTH_K: max_seqlen,
        SEQ_IDX: seq_idx,
        PACKED_BOUNDARIES: boundaries,
        # a packed row has no meaningful cache: several documents would write one state
        "use_cache": False,
    })
    if kwargs.get(POSITION_IDS) is None:
        kwargs[POSITION_IDS] = positions_in_documents(cu_seqlens, seq_idx.flatten()).view(rows, row_length)
    return kwargs


def _host_copy(given: torch.Tensor, prepared: PackedBoundaries | None) -> torch.Tensor | None:
    """The host copy of the boundaries, when the batch brought one (kernels that need host-side sizes read it instead
    of copying ``cu_seqlens`` back from the device); None when a trainer already moved the batch to the device. A
    multimodal entry prepares the batch before its decoder does: the decoder keeps the entry's host copy."""
    if given.device.type == "cpu":
        return given.to(torch.int32)
    return None if prepared is None else prepared.cu_seqlens_cpu


def _refuse_shard(kwargs: dict) -> None:
    """A batch sharded for context parallelism, given to a model patched without it (a static fact)."""
    if kwargs.get(SHARD_KEY) is not None:
        rules.refuse(
            ContextParallelError,
            f"the batch was sharded for context parallelism (it has '{SHARD_KEY}') but the model was patched without "
            "it; patch with compilepack.patch(model, context_parallel=group), or pass the unsharded batch.",
        )


def _max_seqlen(given, row_length, on_host: bool):
    """The kernels' bound on document length: the batch's ``max_length_q`` when it is a Python int (or a host tensor
    read in eager), else the row length. Documents never cross rows, so the row length bounds every document; a
    tensor is not read inside a graph (that would be a sync) but checked there as a bound."""
    if given is None:
        return row_length
    if isinstance(given, torch.Tensor):
        return int(given) if on_host and given.device.type == "cpu" else row_length
    return given


def _refuse_unmarked_packing(kwargs: dict) -> None:
    """Refuse packed rows that carry no boundaries: a batch without boundary kwargs runs every row as one
    sequence, so position_ids that restart inside a row mean the boundaries were dropped.

    Eager with host positions the check runs on the host and raises :class:`compilepack.BoundaryError`. Inside a
    compiled graph, or on an accelerator, reading the positions would be a host sync: there it is an asynchronous
    device assert, which fails the step with a ``RuntimeError`` carrying the same rule (on CUDA at the next
    synchronisation). Padded batches, cached decoding and multimodal (3-D) position ids are not checked."""
    position_ids = kwargs.get(POSITION_IDS)
    if (position_ids is None or position_ids.dim() != 2 or kwargs.get(ATTENTION_MASK) is not None
            or rules.has_cache(kwargs)):
        return
    on_host = position_ids.device.type == "cpu" and not torch.compiler.is_compiling()
    rules.refuse_unmarked_packing(position_ids, read_on_host=on_host)


def _builds_cache(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether the stock decoder will build a cache for this call (then it skips its packed-row detection)."""
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(module, "config", None), "use_cache", False)
    return bool(use_cache)

