"""The boundaries of a packed batch: the keys that carry them, and what is derived from them.

A packed batch is the HF collator's format: tokens of several documents concatenated in one row (``[1, T]``), or
in ``R`` rows whose edges are also document edges, with the boundaries passed alongside as

- ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``int32 [N+1]`` cumulative document lengths over the flattened tokens,
- ``max_length_q`` / ``max_length_k``: Python int, the longest document (any upper bound works),
- ``seq_idx``: ``int32 [R, T]`` document index of every token,
- ``position_ids``: ``int64 [R, T]`` position inside the document (restarting at each document).

This module is the one home of those key names and of the derivations (document starts, ``seq_idx`` and positions
from ``cu_seqlens``): every other module imports them from here. The rules they must satisfy live in
:mod:`compilepack.guards`; :class:`compilepack.Boundaries` (``layout``) builds them on the host. The derivations
are traceable: no host read, no data-dependent shape.
"""

from __future__ import annotations

import torch

# The boundary kwargs, as DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) names them.
CU_SEQLENS_Q, CU_SEQLENS_K = "cu_seq_lens_q", "cu_seq_lens_k"
MAX_LENGTH_Q, MAX_LENGTH_K = "max_length_q", "max_length_k"
SEQ_IDX = "seq_idx"
CU_SEQLENS_KEYS = (CU_SEQLENS_Q, CU_SEQLENS_K)
MAX_LENGTH_KEYS = (MAX_LENGTH_Q, MAX_LENGTH_K)
BOUNDARY_KEYS = (*CU_SEQLENS_KEYS, *MAX_LENGTH_KEYS, SEQ_IDX)
# Other keys of a batch the contract speaks about.
INPUT_IDS, INPUTS_EMBEDS = "input_ids", "inputs_embeds"
POSITION_IDS, ATTENTION_MASK, LABELS = "position_ids", "attention_mask", "labels"
# A cache: ``past_key_values`` up to transformers 5.23, ``cache`` from 5.24.
CACHE_KEYS = ("cache", "past_key_values")
# The name transformers' linear-attention layers hand the boundaries to their delta rule under.
CU_SEQLENS = "cu_seqlens"
# Internal: the host copy of cu_seq_lens_q that the patched decoder hands to the layers (kernels that need host-side
# sizes read it instead of copying the device tensor back). Never part of a user's batch.
HOST_CU_SEQLENS = "cu_seq_lens_q_cpu"
# The keys a patched model moves to the device itself (compilepack.to_device leaves them on the host).
HOST_BOUNDARY_KEYS = CU_SEQLENS_KEYS
# The key compilepack.distributed.shard_batch sets: the context-parallel group a batch was sharded for.
SHARD_KEY = "context_parallel_shard"
# The keys a trainer's loss reads beside the model's own (context-parallel shards carry them).
SHIFT_LABELS, NUM_ITEMS_IN_BATCH = "shift_labels", "num_items_in_batch"

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


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of every token, ``int32 [total]``, from ``cu_seqlens`` ``[N+1]``: document ``i`` holds tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]``.

    One ``searchsorted``. Zero-length documents (the fixed-shape collator's unused slots) take no tokens, so their
    indices never appear: the numbering counts them, as ``Boundaries.from_lengths`` and the HF collator do.
    """
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # Search the whole tensor (size N+1 >= 2), not cu_seqlens[1:]: a size-1 slice for a one-document batch
    # would be specialised by the compiler and cost a recompile.
    return (torch.searchsorted(cu_seqlens, positions, right=True) - 1).to(torch.int32)


def positions_in_documents(cu_seqlens: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    """``int64`` position of every token inside its document (``seq_idx``: flat, from :func:`seq_idx_from_cu_seqlens`)."""
    positions = torch.arange(seq_idx.numel(), device=seq_idx.device)
    return positions - cu_seqlens.to(torch.int64)[seq_idx.to(torch.int64)]
