"""``shard_batch``: the collator's packed batch -> this rank's slice of it, for context parallelism.

Every rank of a context-parallel group receives the same global batch (the same data-loader seed) and keeps:

- its contiguous ``T / W`` slice of every row of the per-token tensors: ``input_ids``, ``position_ids`` (global:
  positions inside each document, sliced, never restarted at the slice) and the labels, *shifted before slicing*
  (``shift_labels``: the target of a rank's last token is the first token of the next rank's slice);
- the global boundaries, unsliced: ``cu_seq_lens_q/k`` and ``max_length_q/k`` over the whole rows, ``seq_idx
  [R, T]``: host data, so no collective is ever spent on them;
- ``num_items_in_batch``: the target count of the whole batch, so that each rank's loss is its tokens' share and
  the ranks' losses add up to the one-process loss (token-weighted mean);
- ``context_parallel_shard``: the :class:`~compilepack.distributed.ContextParallel` it was sharded for, which the
  patched model checks against its own (a batch not sharded, or sharded for another group, is refused:
  :func:`check_batch`).

Rows whose length does not divide by W get a padding document at their end (``pad_token_id``, labels -100), which
attends only to itself and adds nothing to the loss.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from torch import Tensor

from ..batch.keys import (
    CU_SEQLENS_K,
    CU_SEQLENS_Q,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    NUM_ITEMS_IN_BATCH,
    POSITION_IDS,
    SEQ_IDX,
    SHARD_KEY,
    SHIFT_LABELS,
)
from ..errors import ContextParallelError
from ..batch.rules import refuse
from ..batch.layout import Boundaries
from ..batch.keys import IGNORE_INDEX
from ..batch.validation import validate
from .group import ContextParallel


def shard_batch(batch: dict, group_or_mesh, *, pad_token_id: int = 0, verify: bool = True) -> dict:
    """This rank's part of a packed batch, for a model patched with ``context_parallel=group_or_mesh``.

    Example::

        cp_group = dist.new_group([0, 1])                      # or mesh["cp"]
        model = compilepack.patch(model, context_parallel=cp_group)
        batch = collate(features)                              # the same global batch on every rank of the group
        out = model(**compilepack.distributed.shard_batch(batch, cp_group))
        out.loss.backward()                                    # this rank's share of the one-process loss
        compilepack.distributed.all_reduce_gradients(model, cp_group)   # or FSDP2/DDP, see the docs

    Args:
        batch: a packed batch with boundary kwargs (``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
            return_seq_idx=True)`` or ``compilepack.PackedCollator``), ``[R, T]`` rows, on the host; ``labels``
            optional (without them no loss is computed).
        group_or_mesh: the context-parallel process group, or a 1-D DeviceMesh.
        pad_token_id: token of the padding document added when ``T`` does not divide by the group size.
        verify: check (one small all-gather of a fingerprint) that every rank of the group holds the same global
            batch; ranks fed different batches would silently mix them.

    Returns:
        A new dict: ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` ``[R, T' / W]`` (``T'`` the
        padded row length; ``labels`` holds the shifted labels too, so that transformers computes a loss), the
        global ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx [R, T']``, ``num_items_in_batch`` (a 0-dim
        tensor) and ``context_parallel_shard``.

    Raises:
        BoundaryError: the batch is not a valid packed batch (see ``compilepack.validate``).
        ContextParallelError: the batch has no boundaries or multimodal position ids, or (``verify``) the ranks
            hold different batches.
    """
    cp = ContextParallel.of(group_or_mesh)
    if batch.get(INPUT_IDS) is None:
        raise ContextParallelError(f"shard_batch needs '{INPUT_IDS}' (inputs_embeds batches are not supported).")
    boundaries = validate(batch)
    if boundaries is None:
        raise ContextParallelError(
            "shard_batch needs a packed batch with boundary kwargs (cu_seq_lens_q, seq_idx, ...): collate with "
            "DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) or "
            "compilepack.PackedCollator."
        )
    if batch.get(POSITION_IDS) is not None and batch[POSITION_IDS].dim() != 2:
        raise ContextParallelError(
            f"shard_batch: position_ids of shape {tuple(batch[POSITION_IDS].shape)} (multimodal RoPE) are not "
            "supported under context parallelism; pass [rows, T] position ids."
        )
    if verify:
        _verify_same_batch(batch, cp)
    tokens, boundaries = _padded(batch, boundaries, cp.size, pad_token_id)
    local = tokens[INPUT_IDS].shape[1] // cp.size
    start = cp.rank * local
    # contiguous: transformers views them (``shift_labels.view(-1)``), and a column slice of several rows is not
    sharded = {key: value[:, start : start + local].contiguous() for key, value in tokens.items()}
    if LABELS in sharded:
        sharded[SHIFT_LABELS] = sharded[LABELS]
        sharded[NUM_ITEMS_IN_BATCH] = (tokens[LABELS] != IGNORE_INDEX).sum()
    sharded.update({
        # two equal tensors, as the HF collator gives (one object in both: a compiled model's guard on identity)
        CU_SEQLENS_Q: boundaries.cu_seqlens, CU_SEQLENS_K: boundaries.cu_seqlens.clone(),
        MAX_LENGTH_Q: boundaries.max_seqlen, MAX_LENGTH_K: boundaries.max_seqlen, SEQ_IDX: boundaries.seq_idx,
    })
    sharded[SHARD_KEY] = cp
    return sharded


def _padded(batch: dict, boundaries: Boundaries, size: int, pad_token_id: int) -> tuple[dict, Boundaries]:
    """The per-token tensors (labels already shifted) and boundaries of the batch with every row padded to a
    multiple of ``size`` by a padding document at its end."""
    rows, length = batch[INPUT_IDS].shape
    padding = -length % size
    if padding:
        boundaries = _with_padding_documents(boundaries, rows, length, padding)
    tokens = {
        INPUT_IDS: _pad(batch[INPUT_IDS], padding, pad_token_id),
        POSITION_IDS: boundaries.position_ids if padding or batch.get(POSITION_IDS) is None else batch[POSITION_IDS],
    }
    if batch.get(LABELS) is not None:
        tokens[LABELS] = _pad(_shifted(batch[LABELS]), padding, IGNORE_INDEX)
    return tokens, boundaries


def _with_padding_documents(boundaries: Boundaries, rows: int, length: int, padding: int) -> Boundaries:
    """Boundaries with one document of ``padding`` tokens appended to every row (documents never cross rows)."""
    cu = boundaries.cu_seqlens.tolist()
    per_row = [[] for _ in range(rows)]
    for start, end in zip(cu[:-1], cu[1:]):
        per_row[min(start // length, rows - 1)].append(end - start)  # empty documents at the end: the last row
    lengths = [n for row in per_row for n in (*row, padding)]
    padded = Boundaries.from_lengths(lengths, rows=rows, max_seqlen=max(boundaries.max_seqlen, padding))
    # real documents keep the positions the batch gave them (position_ids_start may be nonzero)
    positions = padded.position_ids.clone()
    positions[:, :length] = boundaries.position_ids
    return padded._replace(position_ids=positions)


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal shift over the whole row (token t predicts label t+1; the last predicts nothing),
    done before slicing so a rank's last token keeps its target on the next rank."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _pad(tensor: torch.Tensor, padding: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, padding), value=value) if padding else tensor


def _verify_same_batch(batch: dict, cp: ContextParallel) -> None:
    fingerprint = _fingerprint(batch)
    everyone = [None] * cp.size
    dist.all_gather_object(everyone, fingerprint, group=cp.group)
    different = [rank for rank, other in enumerate(everyone) if other != fingerprint]
    if different:
        raise ContextParallelError(
            f"shard_batch: rank {cp.rank} of the context-parallel group holds a different global batch than "
            f"rank(s) {different}; every rank of a context-parallel group must collate the same batch (same sampler "
            "seed and order; shard data across data-parallel groups only)."
        )


def _fingerprint(batch: dict) -> str:
    digest = hashlib.sha1()
    for key in (INPUT_IDS, CU_SEQLENS_Q, LABELS):
        value = batch.get(key)
        if value is not None:
            digest.update(key.encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ the model's checks


def check_batch(shard: ContextParallel | None, cp: ContextParallel, where: str) -> None:
    """Refuse a packed batch that was not sharded for this model's context parallelism ``cp``: unsharded, or
    sharded for another group or rank. ``shard``: the batch's ``context_parallel_shard`` entry (or its
    ``PackedBoundaries.shard``, in the layers). Compares Python objects only (by identity): free inside a graph,
    where it becomes a guard. (A sharded batch given to a model patched without context parallelism is refused by
    the decoder, which never enters this package then.)"""
    if shard is cp:
        return
    if shard is None:
        refuse(
            ContextParallelError,
            f"{where}: the model runs context-parallel over {cp.size} ranks but the batch was not sharded; pass "
            f"compilepack.distributed.shard_batch(batch, group) (each rank keeps 1/{cp.size} of every row)."
        )
    refuse(
        ContextParallelError,
        f"{where}: the batch was sharded for {shard.describe()} but the model runs {cp.describe()}; shard with the "
        "group the model was patched with."
    )


def check_shard(local: int, global_: int, cp: ContextParallel, where: str) -> None:
    """Refuse a batch whose local length times W is not the length the global boundaries describe: a batch that
    was not sharded (or was sharded for another group size). Static shapes only: safe to trace."""
    if local * cp.size != global_:
        refuse(
            ContextParallelError,
            f"{where}: this rank holds {int(local)} tokens per row but the boundaries (seq_idx) describe rows of "
            f"{int(global_)}; under context parallelism of size {cp.size} each rank must hold exactly 1/{cp.size} of "
            "every row. Shard every batch with compilepack.distributed.shard_batch(batch, group)."
        )


def shards_per_row(kwargs: dict, tokens: Tensor) -> int:
    """For the patched decoder's boundary checks: how many ranks share each row (1 without a shard).

    A context-parallel shard holds ``T / W`` tokens of every row while its ``seq_idx`` and ``cu_seq_lens_q``
    describe the whole rows (``shard_batch``): the boundary checks run on the whole rows (``T = W x T_local``).
    Static facts only: safe to trace."""
    shard = kwargs.get(SHARD_KEY)
    if shard is None:
        return 1
    if kwargs.get(POSITION_IDS) is None:
        refuse(
            ContextParallelError,
            "a context-parallel shard needs its 'position_ids' (positions inside each document, global: they cannot "
            "be derived from a slice of a row); shard with compilepack.distributed.shard_batch, which sets them."
        )
    seq_idx = kwargs.get(SEQ_IDX)
    if isinstance(seq_idx, Tensor) and seq_idx.dim() == 2:  # (otherwise the static checks refuse it themselves)
        check_shard(tokens.shape[1], seq_idx.shape[1], shard, "the packed decoder")
    return shard.size
