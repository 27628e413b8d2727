"""Context parallelism over tokens: what a rank's slice of every row sees of the global boundaries, and the state
its linear mixers (Gated DeltaNet, Kimi delta attention, Mamba2) pass from rank to rank.

Each of W ranks holds tokens ``start = r * T_local`` to ``start + T_local`` of every row, and every rank has the
global boundaries (``cu_seqlens`` over the whole rows, ``seq_idx [R, T]``): which document crosses which rank edge is
read from them with tensor ops (no host read, no branch on data), so a compiled graph serves every batch.

The state pass. A linear mixer's state is affine in the state a rank's first document brings in: the rank runs its
slice from a zero state and gets, per row, its final state ``b`` and the transform ``A`` the slice applies to an
incoming state (a ``[K, K]`` matrix per head for the delta rules, a per-head scalar decay for Mamba2; zero unless the
whole slice is one document), so the state leaving rank r is ``A_r S_in[r] + b_r``, and the state entering rank
r + 1 is that state where the document continues across the edge, else zero. :func:`incoming_states` solves this
first-order recurrence over the ranks with one of two schedules:

- ``"sequential"``: W - 1 rounds, each a send of the ``[K, V]`` states to the next rank: ``(W - 1) |b|`` elements
  per rank, W - 1 dependent latencies;
- ``"log"``: a prefix scan by recursive doubling (Hillis-Steele over the ranks): round i sends the pairs
  ``(A, b)`` a distance ``2^i`` and composes them, then one send of the states to the next rank:
  ``ceil(log2 W) |b| + (ceil(log2 W) - 1) |A| + |b|`` elements, ``ceil(log2 W) + 1`` latencies;
- ``"auto"`` (the default): the schedule that sends fewer elements, the log-depth one on a tie (fewer latencies).

Both are traced code over functional collectives (:func:`~compilepack.distributed.collectives.send_forward`), so the
backward is autograd's: the mirror scan, each send reversed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import collectives

SCHEDULES = ("auto", "sequential", "log")


def token_slice(cp, local: int) -> tuple[int, int]:
    """``(start, end)`` of this rank's slice of every row."""
    return cp.rank * local, (cp.rank + 1) * local


def local_cu_seqlens(cu_seqlens: Tensor, rows: int, length: int, start, width) -> Tensor:
    """``cu_seqlens`` over ``rows`` rows of ``length`` tokens (flattened) -> the boundaries of tokens ``start`` to
    ``start + width`` of every row, flattened (rows of ``width``): every document keeps its index, the part of it
    outside the window becomes empty (a document crossing ``start`` starts at the window start)."""
    row = torch.div(cu_seqlens, length, rounding_mode="floor").clamp(max=rows - 1)
    position = cu_seqlens - row * length
    return (row * width + (position - start).clamp(0, width)).to(cu_seqlens.dtype)


def continues_from_cu_seqlens(cu_seqlens: Tensor, rows: int, length: int, start) -> Tensor:
    """``[R]`` bool: whether the document at position ``start`` of each row started before it (no boundary there).
    False at ``start = 0`` (every row start is a boundary)."""
    edges = torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype) * length + start
    return ~(cu_seqlens[None, :] == edges[:, None]).any(-1)


def continues_from_seq_idx(seq_idx: Tensor, start, cp) -> Tensor:
    """``[R]`` bool: whether the token at position ``start`` of each row continues the document of the token before
    it (False on the first rank)."""
    if cp.rank == 0:
        return torch.zeros(seq_idx.shape[0], dtype=torch.bool, device=seq_idx.device)
    # slices, not an index: a symbolic index would specialise the slice length (a recompile per batch)
    return (seq_idx[:, start : start + 1] == seq_idx[:, start - 1 : start])[:, 0]


def incoming_states(transform: Tensor, final: Tensor, continues: Tensor, cp, schedule: str | None = None) -> Tensor:
    """The state each row's first document brings into this rank's slice (zero where it starts in the slice).

    Args:
        transform: ``[R, H, K, K]`` (a matrix applied on the left of the state) or ``[R, H]`` (a per-head decay):
            what the slice does to an incoming state (zero where the slice is not one document).
        final: ``[R, H, K, V]``: the slice's final state from a zero incoming state.
        continues: ``[R]`` bool: whether the slice's first document crosses its left edge.
        cp: the token-parallel group.
        schedule: ``"sequential"``, ``"log"``, ``"auto"``; None: ``cp.state_pass``.

    Returns:
        ``[R, H, K, V]`` in ``final``'s dtype.
    """
    schedule = chosen_schedule(transform.numel(), final.numel(), cp.size, schedule or cp.state_pass)
    mask = continues.to(final.dtype)[:, None, None, None]
    if cp.size == 1:
        return final * 0
    if schedule == "sequential":
        return _sequential(transform, final, mask, cp)
    return _log_depth(transform, final, mask, cp)


def chosen_schedule(transform_size: int, state_size: int, world: int, schedule: str) -> str:
    """The schedule ``"auto"`` stands for: the one that sends fewer elements (log-depth on a tie)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"state_pass must be one of {SCHEDULES}, got {schedule!r}.")
    if schedule != "auto":
        return schedule
    sequential, log = schedule_elements(transform_size, state_size, world)
    return "log" if log <= sequential else "sequential"


def schedule_elements(transform_size: int, state_size: int, world: int) -> tuple[int, int]:
    """Elements one rank sends for one state pass (forward; the backward sends as many): ``(sequential, log)``."""
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    log = rounds * state_size + max(rounds - 1, 0) * transform_size + state_size * (world > 1)
    return (world - 1) * state_size, log


def _apply(transform: Tensor, state: Tensor) -> Tensor:
    if transform.dim() == state.dim():
        return transform @ state
    return transform[..., None, None] * state


def _sequential(transform: Tensor, final: Tensor, mask: Tensor, cp) -> Tensor:
    """W - 1 rounds: after round j the ranks up to j hold their true outgoing state."""
    leaving, incoming = final, None
    for _ in range(cp.size - 1):
        incoming = collectives.send_forward(leaving, cp) * mask
        leaving = _apply(transform, incoming) + final
    return incoming


def _log_depth(transform: Tensor, final: Tensor, mask: Tensor, cp) -> Tensor:
    """Recursive doubling: after the round of distance d, rank r holds the composition of the maps of ranks
    ``r - 2d + 1 .. r`` (fewer at the start), so its ``b`` is its outgoing state after ``ceil(log2 W)`` rounds."""
    matrix = transform.dim() == final.dim()
    transform = transform * (mask if matrix else mask[..., 0, 0])  # a slice whose document starts in it ignores S_in
    identity = torch.eye(transform.shape[-1], dtype=transform.dtype, device=transform.device) if matrix else 1.0
    leaving, distance = final, 1
    while distance < cp.size:
        last = 2 * distance >= cp.size  # the last round needs only the states
        parts = [leaving] if last else [leaving, transform]
        received = collectives.send_forward(torch.cat([p.reshape(*p.shape[:2], -1) for p in parts], -1), cp, distance)
        keep = float(cp.rank >= distance)  # the first ranks receive the last ranks' maps: they keep their own
        earlier = received[..., : leaving[0, 0].numel()].view(leaving.shape) * keep
        if not last:
            earlier_transform = received[..., leaving[0, 0].numel() :].view(transform.shape)
            earlier_transform = earlier_transform * keep + identity * (1 - keep)
        leaving = _apply(transform, earlier) + leaving
        if not last:
            transform = transform @ earlier_transform if matrix else transform * earlier_transform
        distance *= 2
    return collectives.send_forward(leaving, cp) * mask
