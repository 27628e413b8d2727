"""``mamba2_chunk_scan_varlen`` under context parallelism: head-parallel (Ulysses) over the whole rows.

SSM heads (with their ``dt``, ``A``, ``D``, ``dt_bias``) are split in W slices between two all-to-alls; B/C groups
split alike when W divides them, else replicated (one group per rank). The gated norm after the scan runs per token
on the token shard: no split.
"""

from __future__ import annotations

from torch import Tensor

from ...distributed.collectives import gather_heads, head_split, rank_slice, split_heads, split_read_heads
from ...distributed.sharding import check_shard
from . import mamba2_chunk_scan_varlen


def mamba2_chunk_scan_head_parallel(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
    *, seq_idx: Tensor, backend: str, cp,
) -> Tensor:
    """:func:`~compilepack.ops.mamba2_chunk_scan_varlen` on a token shard ``x [R, T_local, H, P]`` with the global
    ``seq_idx [R, T]``: each rank scans ``H / W`` heads (their ``dt``, ``A``, ``D``, ``dt_bias``) and the B/C
    groups they read, over the whole rows."""
    where = "Mamba2 scan"
    check_shard(x.shape[1], seq_idx.shape[-1], cp, where)
    per_rank = head_split(x.shape[2], B.shape[2], cp.size, where, "mamba_n_heads", "mamba_n_groups")
    B, C = (split_read_heads(t, cp, per_rank) for t in (B, C))
    y = mamba2_chunk_scan_varlen(
        split_heads(x, cp), split_heads(dt, cp), rank_slice(A, cp), B, C, chunk_size, D=rank_slice(D, cp),
        dt_bias=rank_slice(dt_bias, cp), dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx,
        backend=backend,
    )
    return gather_heads(y, cp)
