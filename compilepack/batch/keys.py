"""The keys of a packed batch that carry its boundaries, and the batch's constants.

A packed batch is the HF collator's format: tokens of several documents concatenated in one row (``[1, T]``), or
in ``R`` rows whose edges are also document edges, with the boundaries passed alongside as

- ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``int32 [N+1]`` cumulative document lengths over the flattened tokens,
- ``max_length_q`` / ``max_length_k``: Python int, the longest document (any upper bound works),
- ``seq_idx``: ``int32 [R, T]`` document index of every token,
- ``position_ids``: ``int64 [R, T]`` position inside the document (restarting at each document).

This module is the one home of those key names and of the batch's constants: every other module imports them from
here. What a model derives from them is :mod:`.derived`; the rules they must satisfy are :mod:`.rules`;
:class:`~compilepack.Boundaries` (:mod:`.layout`) builds them on the host.
"""

from __future__ import annotations

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
# Internal: the key under which the patched decoder hands its layers the batch's boundaries as one typed value
# (:class:`~compilepack.batch.derived.PackedBoundaries`), beside the HF keys stock code reads. Never part of a user's
# batch.
PACKED_BOUNDARIES = "compilepack_boundaries"
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
# The label a loss skips (ForCausalLMLoss's default ignore_index): a packed row carries it at each document start.
IGNORE_INDEX = -100
