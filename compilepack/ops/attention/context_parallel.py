"""``varlen_attention`` under context parallelism: head-parallel (Ulysses) over the whole rows.

Query heads are split in W contiguous slices between two all-to-alls; key/value heads split alike when W divides
them, else (fewer kv heads than W, W a multiple of them) each rank receives the one kv head its query heads read
(replicated, as Megatron and DeepSpeed Ulysses do).
"""

from __future__ import annotations

from torch import Tensor

from ...distributed.collectives import gather_heads, head_split, split_heads, split_read_heads
from ...distributed.sharding import check_shard
from . import varlen_attention


def varlen_attention_head_parallel(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, global_length: int, cp,
    where: str, **op_kwargs,
) -> Tensor:
    """:func:`~compilepack.ops.varlen_attention` on a token shard: ``[R, H, T_local, D]`` query/key/value (the layout
    transformers' attention functions receive) -> ``[R, T_local, H, Dv]``. ``cu_seqlens`` and ``max_seqlen`` are
    the global boundaries over ``R`` rows of ``global_length`` tokens; ``op_kwargs`` go to the op."""
    rows, heads, local, _ = query.shape
    check_shard(local, global_length, cp, where)
    kv_per_rank = head_split(heads, key.shape[1], cp.size, where, "num_attention_heads", "num_key_value_heads")
    q = split_heads(query.transpose(1, 2), cp)
    k, v = (split_read_heads(x.transpose(1, 2), cp, kv_per_rank) for x in (key, value))
    total, local_heads = q.shape[1], q.shape[2]
    out = varlen_attention(
        q.reshape(rows * total, local_heads, -1), k.reshape(rows * total, k.shape[2], -1),
        v.reshape(rows * total, v.shape[2], -1), cu_seqlens, max_seqlen, **op_kwargs,
    )
    return gather_heads(out.view(rows, total, local_heads, -1), cp)
