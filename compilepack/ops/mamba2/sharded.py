"""``mamba2_chunk_scan_varlen`` under context parallelism. The gated norm after the scan runs per token on the token
shard: no split.

- Ulysses (head-parallel over the whole rows): SSM heads (with their ``dt``, ``A``, ``D``, ``dt_bias``) are split in
  W slices between two all-to-alls; B/C groups split alike when W divides them, else replicated (one group per rank).
- Over tokens: each rank scans its slice of every row from a zero state, then adds the state its first document
  brings in, passed across the ranks (:mod:`compilepack.distributed.scan`). Per head the state ``h [P, N]`` follows
  ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``: affine in the incoming state with a scalar transform, ``h_t =
  alpha_t h_in + h^0_t``, ``alpha_t`` the product of the first document's decays up to t; so ``y_t += alpha_t
  (h_in C_t)`` and the state leaving the slice is ``alpha_T h_in + h^0_T`` (``alpha_T`` 0 unless the slice is one
  document). The op's state variant returns ``y^0``, ``h^0_T`` and ``alpha``.
- Hybrid: head-parallel inside a Ulysses group, over tokens across the groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...distributed import scan
from ...distributed.collectives import gather_heads, head_split, rank_slice, split_heads, split_read_heads
from ...distributed.sharding import check_shard
from . import mamba2_chunk_scan_varlen, mamba2_chunk_scan_varlen_state

WHERE = "Mamba2 scan"


def mamba2_chunk_scan_head_parallel(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
    *, seq_idx: Tensor, backend: str, cp,
) -> Tensor:
    """:func:`~compilepack.ops.mamba2_chunk_scan_varlen` on a token shard ``x [R, T_local, H, P]`` with the global
    ``seq_idx [R, T]``: each rank scans ``H / W`` heads (their ``dt``, ``A``, ``D``, ``dt_bias``) and the B/C
    groups they read, over the whole rows."""
    check_shard(x.shape[1], seq_idx.shape[-1], cp, WHERE)
    per_rank = head_split(x.shape[2], B.shape[2], cp.size, WHERE, "mamba_n_heads", "mamba_n_groups")
    B, C = (split_read_heads(t, cp, per_rank) for t in (B, C))
    y = mamba2_chunk_scan_varlen(
        split_heads(x, cp), split_heads(dt, cp), rank_slice(A, cp), B, C, chunk_size, D=rank_slice(D, cp),
        dt_bias=rank_slice(dt_bias, cp), dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx,
        backend=backend,
    )
    return gather_heads(y, cp)


def mamba2_chunk_scan_sequence_parallel(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
    *, seq_idx: Tensor, backend: str, cp,
) -> Tensor:
    """:func:`~compilepack.ops.mamba2_chunk_scan_varlen` on this rank's slice ``x [R, T_local, H, P]`` of every row
    (the global ``seq_idx [R, T]``), over tokens: the slice from a zero state, then the incoming state's share."""
    rows, local, heads, _ = x.shape
    start, end = scan.token_slice(cp, local)
    y, final, alpha = mamba2_chunk_scan_varlen_state(
        x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        seq_idx=seq_idx[:, start:end], backend=backend,
    )
    continues = scan.continues_from_seq_idx(seq_idx, start, cp)
    incoming = scan.incoming_states(alpha[:, -1], final, continues, cp)  # [R, H, P, N]
    C_per_head = C.to(y.dtype).repeat_interleave(heads // C.shape[2], dim=2)
    return y + alpha[..., None] * torch.einsum("bthn,bhpn->bthp", C_per_head, incoming)


def mamba2_chunk_scan_sharded(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
    *, seq_idx: Tensor, backend: str, cp,
) -> Tensor:
    """The scan under ``cp``'s layout: head-parallel (Ulysses), over tokens (sequence), or head-parallel inside
    each Ulysses group and over tokens across the groups (hybrid)."""
    options = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx, backend=backend)
    if cp.tokens is None:
        return mamba2_chunk_scan_head_parallel(x, dt, A, B, C, chunk_size, cp=cp, **options)
    check_shard(x.shape[1], seq_idx.shape[-1], cp, WHERE)
    heads = cp.heads
    if heads is None:
        return mamba2_chunk_scan_sequence_parallel(x, dt, A, B, C, chunk_size, cp=cp.tokens, **options)
    per_rank = head_split(x.shape[2], B.shape[2], heads.size, WHERE, "mamba_n_heads", "mamba_n_groups")
    B, C = (split_read_heads(t, heads, per_rank) for t in (B, C))
    options.update(D=rank_slice(D, heads), dt_bias=rank_slice(dt_bias, heads))
    y = mamba2_chunk_scan_sequence_parallel(
        split_heads(x, heads), split_heads(dt, heads), rank_slice(A, heads), B, C, chunk_size, cp=cp.tokens, **options
    )
    return gather_heads(y, heads)
