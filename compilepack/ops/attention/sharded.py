"""``varlen_attention`` under context parallelism.

- Ulysses (head-parallel over the whole rows): query heads are split in W contiguous slices between two
  all-to-alls; key/value heads split alike when W divides them, else (fewer kv heads than W, W a multiple of them)
  each rank receives the one kv head its query heads read (replicated, as Megatron and DeepSpeed Ulysses do).
- Over tokens: each rank keeps its queries and attends them to the keys and values of the whole rows, all-gathered
  (with grouped-query attention they are the small part), each query to its own document's keys up to itself: the
  global ``cu_seqlens`` give each document's queries on this rank and its keys up to this rank's slice end
  (``compilepack::varlen_attention_kv``). The all-gather's backward is a reduce-scatter of the keys' gradients.
  (A ring, passing key/value blocks from rank to rank, would hold 2 blocks instead of the whole rows but send as
  much forward and twice as much backward, since the key/value gradients travel the ring too: see
  docs/context-parallel.md.)
- Hybrid: head-parallel inside a Ulysses group, over tokens across the groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...distributed import collectives, scan
from ...distributed.collectives import gather_heads, head_split, split_heads, split_read_heads
from ...distributed.sharding import check_shard
from ...errors import ContextParallelError
from . import varlen_attention, varlen_attention_kv


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


def varlen_attention_sequence_parallel(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, cp, causal: bool = True,
    window: int | None = None, cu_seqlens_cpu: Tensor | None = None, **op_kwargs,
) -> Tensor:
    """Attention of this rank's queries ``q [R, T_local, H, D]`` over tokens: keys and values ``[R, T_local, Hkv,
    D]`` all-gathered along the rows (in one collective), each query attending its document's keys up to itself
    (the causal case needs the keys up to this slice's end only) -> ``[R, T_local, H, Dv]``."""
    rows, local, heads = q.shape[:3]
    length = local * cp.size
    start, end = scan.token_slice(cp, local)
    if not causal:
        if window is not None:
            raise ContextParallelError("attention over tokens: a non-causal sliding window is not supported.")
        end = length  # every key of the document
    key_dim = k.shape[-1]
    keys_values = collectives.gather_tokens(torch.cat([k, v], -1), cp)[:, :end]  # [R, end, Hkv, D + Dv]
    k, v = (x.reshape(rows * end, *x.shape[2:]) for x in keys_values.split([key_dim, v.shape[-1]], -1))
    bounds = {
        "cu_seqlens_q": scan.local_cu_seqlens(cu_seqlens, rows, length, start, local),
        "cu_seqlens_k": scan.local_cu_seqlens(cu_seqlens, rows, length, 0, end),
    }
    if cu_seqlens_cpu is not None:
        bounds["cu_seqlens_q_cpu"] = scan.local_cu_seqlens(cu_seqlens_cpu, rows, length, start, local)
        bounds["cu_seqlens_k_cpu"] = scan.local_cu_seqlens(cu_seqlens_cpu, rows, length, 0, end)
    out = varlen_attention_kv(
        q.reshape(rows * local, heads, -1), k, v, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=causal,
        window=window, **bounds, **op_kwargs,
    )
    return out.view(rows, local, heads, -1)


def varlen_attention_sharded(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, global_length: int, cp,
    where: str, **op_kwargs,
) -> Tensor:
    """Attention under ``cp``'s layout, on ``[R, H, T_local, D]`` query/key/value (transformers' layout) ->
    ``[R, T_local, H, Dv]``: head-parallel (Ulysses), over tokens (sequence), or head-parallel inside each Ulysses
    group and over tokens across the groups (hybrid)."""
    if cp.tokens is None:
        return varlen_attention_head_parallel(query, key, value, cu_seqlens, max_seqlen, global_length=global_length,
                                              cp=cp, where=where, **op_kwargs)
    check_shard(query.shape[2], global_length, cp, where)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [R, T_local, heads, D]
    heads = cp.heads
    if heads is not None:
        kv_per_rank = head_split(q.shape[2], k.shape[2], heads.size, where, "num_attention_heads",
                                 "num_key_value_heads")
        q = split_heads(q, heads)
        k, v = (split_read_heads(x, heads, kv_per_rank) for x in (k, v))
    out = varlen_attention_sequence_parallel(q, k, v, cu_seqlens, max_seqlen, cp=cp.tokens, **op_kwargs)
    return out if heads is None else gather_heads(out, heads)
