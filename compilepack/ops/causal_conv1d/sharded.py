"""``causal_conv1d_varlen`` under context parallelism.

- Ulysses (channel-parallel over the whole rows): the conv is depthwise, so each rank convolves ``C / W`` channels
  of the whole rows with its slice of the weight and bias, between two all-to-alls.
- Over tokens: each rank convolves its own slice after a halo of the ``kernel - 1`` tokens before it (the previous
  rank's last tokens).
- Hybrid: channel-parallel inside a Ulysses group, over tokens across the groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...distributed import collectives
from ...distributed.collectives import gather_heads, rank_slice, split_heads
from ...distributed.sharding import check_shard
from ...errors import ContextParallelError
from . import causal_conv1d_varlen

WHERE = "causal conv1d"


def causal_conv1d_head_parallel(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor, activation: str | None, *, backend: str, cp,
) -> Tensor:
    """:func:`~compilepack.ops.causal_conv1d_varlen` on a token shard ``x [R, C, T_local]`` with the global
    ``seq_idx [R, T]``: each rank convolves ``C / W`` channels of the whole rows with its slice of the weight."""
    check_shard(x.shape[2], seq_idx.shape[-1], cp, WHERE)
    _check_channels(x.shape[1], cp)
    shard = split_heads(x.transpose(1, 2), cp).transpose(1, 2)  # [R, C / W, T]
    out = causal_conv1d_varlen(shard, rank_slice(weight, cp), rank_slice(bias, cp), seq_idx, activation,
                               backend=backend)
    return gather_heads(out.transpose(1, 2), cp).transpose(1, 2)


def _check_channels(channels: int, cp) -> None:
    if channels % cp.size:
        raise ContextParallelError(
            f"{WHERE}: its {channels} channels (the layer's conv_dim) do not divide by the context-parallel size "
            f"{cp.size}; Ulysses splits the channels across ranks, so conv_dim must be a multiple of {cp.size}."
        )


def causal_conv1d_sequence_parallel(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor, activation: str | None, *, backend: str, cp,
) -> Tensor:
    """:func:`~compilepack.ops.causal_conv1d_varlen` on this rank's slice ``x [R, C, T_local]`` of every row (the
    global ``seq_idx [R, T]``), over tokens: the slice is convolved after a halo of the ``kernel - 1`` tokens before
    it, whose taps count only where a document crosses the slice start (the op's same-document factors, from the
    global ``seq_idx``, zero them elsewhere; before the row start the halo is zeros of a document of their own). The
    halo is the previous rank's last tokens, sent to the next rank (on the first rank, the last rank's: masked the
    same way); when a slice is shorter than the halo, every rank's slice is all-gathered instead. The halo's gradient
    goes back to the rank it came from (the collective's backward)."""
    rows, channels, local = x.shape
    width = weight.shape[1] - 1  # the halo: the taps that reach back before a token
    start = cp.rank * local
    ids = seq_idx[:, start : start + local]
    if width == 0:  # a 1-tap conv reads no other token
        return causal_conv1d_varlen(x, weight, bias, ids, activation, backend=backend)
    x_RTC = x.transpose(1, 2)
    if local >= width:
        received = collectives.halo(x_RTC[:, local - width :], cp)  # [R, width, C]
    else:  # the window reaches past the previous rank: the tokens before this slice, zeros before the row start
        everyone = collectives.gather_tokens(x_RTC, cp)  # [R, T, C]
        received = torch.cat([everyone.new_zeros(rows, width, channels), everyone], 1)[:, start : start + width]
    positions = torch.arange(width, device=seq_idx.device) + (start - width)  # the halo's tokens in the row
    halo_ids = torch.where(positions >= 0, seq_idx[:, positions.clamp(min=0)], seq_idx[:, :1] - 1)
    out = causal_conv1d_varlen(
        torch.cat([received, x_RTC], 1).transpose(1, 2), weight, bias, torch.cat([halo_ids, ids], 1), activation,
        backend=backend,
    )
    # channel-last, as the op's own output is (callers transpose and view it)
    return out.transpose(1, 2)[:, width:].contiguous().transpose(1, 2)


def causal_conv1d_sharded(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor, activation: str | None, *, backend: str, cp,
) -> Tensor:
    """The conv under ``cp``'s layout: channel-parallel (Ulysses), over tokens (sequence), or channel-parallel
    inside each Ulysses group and over tokens across the groups (hybrid)."""
    if cp.tokens is None:
        return causal_conv1d_head_parallel(x, weight, bias, seq_idx, activation, backend=backend, cp=cp)
    check_shard(x.shape[2], seq_idx.shape[-1], cp, WHERE)
    heads = cp.heads
    if heads is not None:  # hybrid: this Ulysses group's channels of its part of every row
        _check_channels(x.shape[1], heads)
        x = split_heads(x.transpose(1, 2), heads).transpose(1, 2)
        weight, bias = rank_slice(weight, heads), rank_slice(bias, heads)
    out = causal_conv1d_sequence_parallel(x, weight, bias, seq_idx, activation, backend=backend, cp=cp.tokens)
    return out if heads is None else gather_heads(out.transpose(1, 2), heads).transpose(1, 2)
