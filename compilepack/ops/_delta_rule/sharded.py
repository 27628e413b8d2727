"""The delta rules under context parallelism, shared by the gated delta rule and Kimi delta attention (the functions
take the op; each rule's ``sharded.py`` binds its own).

- Ulysses (head-parallel over the whole rows): value heads (with their ``g`` and ``beta``) are split in W slices
  between two all-to-alls; query/key heads split alike when W divides them, else each rank receives the one q/k
  head its value heads read (``num_k_heads <= num_v_heads``).
- Over tokens: each rank runs its slice of every row once, from a known state, and the state the slice's first
  document brings in is passed across the ranks afterwards (:mod:`compilepack.distributed.scan`). The recurrence
  ``S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T`` (a scalar ``g_t`` for the gated delta
  rule, per channel for KDA) acts on each column of the ``[K, V]`` state alike, so it is affine in the incoming
  state: ``S_t = M_t S_in + S_t^0`` with ``M_t = prod_{s <= t} (I - beta_s k_s k_s^T) diag(exp g_s)`` and ``S^0``
  the state from zero, and ``o_t = S_t^T q_t = o_t^0 + S_in^T (M_t^T q_t)``. One pass of the op's state variant on
  the value columns ``[v | 0]`` from the state ``[0 | I_K]`` yields all of it: the outputs ``[o^0 | M_t^T q_t]`` and
  the final state ``[S^0_T | M_T]``. The ranks then pass ``S_out = M_T S_in + S^0_T`` along, and each corrects its
  first document's outputs by ``(M_t^T q_t)^T S_in`` (zero on the other documents' tokens).
- Hybrid: head-parallel inside a Ulysses group, over tokens across the groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ...distributed import scan
from ...distributed.collectives import gather_heads, head_split, split_heads, split_read_heads
from .._chunked import compute_dtype


def head_parallel(
    varlen: Callable, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, *, cp,
    where: str, **op_kwargs,
) -> Tensor:
    """A delta-rule op ``varlen`` on a token shard (``[R, T_local, heads, ...]``) with the global ``cu_seqlens``:
    each rank runs ``HV / W`` value heads (their ``g``, ``beta``) and the q/k heads they read, over the whole
    rows."""
    per_rank = head_split(v.shape[2], q.shape[2], cp.size, where, "linear_num_value_heads", "linear_num_key_heads")
    q, k = (split_read_heads(x, cp, per_rank) for x in (q, k))
    v, g, beta = (split_heads(x, cp) for x in (v, g, beta))
    return gather_heads(varlen(q, k, v, g, beta, cu_seqlens, **op_kwargs), cp)


def sequence_parallel(
    state_op: Callable, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, *, cp,
    cu_seqlens_cpu: Tensor | None = None, **op_kwargs,
) -> Tensor:
    """A delta rule on this rank's slice ``[R, T_local, heads, ...]`` of every row with the global ``cu_seqlens``,
    over tokens: ``state_op`` (the op's state variant) runs the slice once, from the state ``[0 | I]`` on the value
    columns ``[v | 0]``, and the state its first document brings in corrects the outputs after the state pass."""
    rows, local, value_heads, value_dim = v.shape
    key_dim, length = q.shape[3], local * cp.size
    start, _ = scan.token_slice(cp, local)
    bounds = scan.local_cu_seqlens(cu_seqlens, rows, length, start, local)
    host = None if cu_seqlens_cpu is None else scan.local_cu_seqlens(cu_seqlens_cpu, rows, length, start, local)
    identity = torch.eye(key_dim, dtype=compute_dtype(q), device=v.device).expand(rows, value_heads, key_dim, key_dim)
    initial = torch.cat([identity.new_zeros(rows, value_heads, key_dim, value_dim), identity], -1)
    values = torch.cat([v, v.new_zeros(rows, local, value_heads, key_dim)], -1)
    o, final = state_op(q, k, values, g, beta, bounds, initial, cu_seqlens_cpu=host, **op_kwargs)
    o_from_zero, o_per_state = o.split([value_dim, key_dim], -1)  # o^0 and M_t^T q_t
    final, transform = final.split([value_dim, key_dim], -1)  # S^0_T and M_T
    continues = scan.continues_from_cu_seqlens(cu_seqlens, rows, length, start)
    incoming = scan.incoming_states(transform, final, continues, cp)  # [R, HV, K, V]
    carried = torch.einsum("bthk,bhkv->bthv", o_per_state.to(incoming.dtype), incoming)
    return o_from_zero + carried.to(o_from_zero.dtype)


def sharded(
    varlen: Callable, state_op: Callable, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    cu_seqlens: Tensor, *, cp, where: str, **op_kwargs,
) -> Tensor:
    """A delta rule under ``cp``'s layout: head-parallel (Ulysses), over tokens (sequence), or head-parallel inside
    each Ulysses group and over tokens across the groups (hybrid)."""
    if cp.tokens is None:
        return head_parallel(varlen, q, k, v, g, beta, cu_seqlens, cp=cp, where=where, **op_kwargs)
    over_tokens = functools.partial(sequence_parallel, state_op, cp=cp.tokens)
    if cp.heads is None:
        return over_tokens(q, k, v, g, beta, cu_seqlens, **op_kwargs)
    return head_parallel(over_tokens, q, k, v, g, beta, cu_seqlens, cp=cp.heads, where=where, **op_kwargs)
