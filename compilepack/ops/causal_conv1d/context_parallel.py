"""``causal_conv1d_varlen`` under context parallelism: channel-parallel (Ulysses) over the whole rows.

The conv is depthwise: each rank convolves ``C / W`` channels of the whole rows with its slice of the weight and
bias, between two all-to-alls.
"""

from __future__ import annotations

from torch import Tensor

from ...distributed.collectives import gather_heads, rank_slice, split_heads
from ...distributed.sharding import check_shard
from ...errors import ContextParallelError
from . import causal_conv1d_varlen


def causal_conv1d_head_parallel(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor, activation: str | None, *, backend: str, cp,
) -> Tensor:
    """:func:`~compilepack.ops.causal_conv1d_varlen` on a token shard ``x [R, C, T_local]`` with the global
    ``seq_idx [R, T]``: each rank convolves ``C / W`` channels of the whole rows with its slice of the weight."""
    channels, local = x.shape[1], x.shape[2]
    where = "causal conv1d"
    check_shard(local, seq_idx.shape[-1], cp, where)
    if channels % cp.size:
        raise ContextParallelError(
            f"{where}: its {channels} channels (the layer's conv_dim) do not divide by the context-parallel size "
            f"{cp.size}; Ulysses splits the channels across ranks, so conv_dim must be a multiple of {cp.size}."
        )
    shard = split_heads(x.transpose(1, 2), cp).transpose(1, 2)  # [R, C / W, T]
    out = causal_conv1d_varlen(shard, rank_slice(weight, cp), rank_slice(bias, cp), seq_idx, activation, backend=backend)
    return gather_heads(out.transpose(1, 2), cp).transpose(1, 2)
