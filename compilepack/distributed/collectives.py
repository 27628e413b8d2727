"""The collectives of context parallelism.

Ulysses: the all-to-alls between a token shard of every row and a head shard of whole rows. Over tokens: the send
of a few tokens or a small state to the next rank (:func:`send_forward`, a halo or a state pass) and the all-gather
of keys and values (:func:`gather_tokens`).

Layout of a shard: ``[R, T_local, heads, ...]`` (tokens first, as transformers' projections are). Rank ``j`` of the
group holds tokens ``j * T_local : (j + 1) * T_local`` of every row. Only activations travel, through functional
collectives (``all_to_all_single``, ``all_gather_single``), which ``torch.compile(fullgraph=True)`` keeps in the
graph and whose backward torch provides (the reverse all-to-all; a reduce-scatter). ``cp`` is a
:class:`~compilepack.distributed.ContextParallel` (its ``group``, ``size`` and ``rank``).

Every rank issues the same collectives in the same order with the same shapes, whatever its data: a send to the
next rank is a cyclic shift (the first ranks receive the last ranks' data, which the caller masks out), so no rank's
result is empty or constant, and the compiled backward of every rank runs the same collectives in the same order.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from ..errors import ContextParallelError


def head_split(heads: int, read_heads: int, size: int, where: str, heads_name: str, read_name: str) -> int:
    """How many of ``read_heads`` (kv heads, q/k heads, B/C groups) each rank receives when ``heads`` (the heads
    the op outputs: query heads, value heads, SSM heads) are split in ``size`` contiguous slices.

    ``heads`` must divide by ``size``. ``read_heads`` are split alike when they divide by ``size``; when fewer, and
    ``size`` is a multiple of them, each rank receives the one read head its slice of ``heads`` reads (replicated,
    as Megatron and DeepSpeed Ulysses do).
    """
    if heads % size:
        raise ContextParallelError(
            f"{where}: {heads_name}={heads} does not divide by the context-parallel size {size}; Ulysses splits "
            f"{heads_name} across ranks, so {heads_name} must be a multiple of {size} (use a context-parallel size "
            "that divides it, or split the tokens instead: ContextParallel.sequence_parallel or .hybrid)."
        )
    if read_heads % size == 0:
        return read_heads // size
    if size % read_heads == 0:
        return 1
    raise ContextParallelError(
        f"{where}: {read_name}={read_heads} and the context-parallel size {size} do not divide one another; "
        f"{read_name} must be a multiple of {size} (split across ranks) or divide {size} (replicated)."
    )


def split_heads(x: Tensor, cp) -> Tensor:
    """``[R, T_local, H, ...]`` token shard -> ``[R, T, H / W, ...]`` head shard of the whole rows."""
    rows, local, heads = x.shape[:3]
    send = x.reshape(rows, local, cp.size, heads // cp.size, *x.shape[3:]).movedim(2, 0).contiguous()
    received = all_to_all(send, cp)  # [W (source rank = token slice), R, T_local, H / W, ...]
    return received.movedim(0, 1).reshape(rows, cp.size * local, heads // cp.size, *x.shape[3:]).contiguous()


def split_read_heads(x: Tensor, cp, per_rank: int) -> Tensor:
    """Like :func:`split_heads` for heads that other heads read (kv heads, q/k heads, groups): when ``per_rank`` is
    1 and there are fewer heads than ranks, each head is repeated for the ranks whose slice reads it."""
    heads = x.shape[2]
    if heads == per_rank * cp.size:
        return split_heads(x, cp)
    return split_heads(x.repeat_interleave(cp.size // heads, dim=2), cp)


def gather_heads(y: Tensor, cp) -> Tensor:
    """Inverse of :func:`split_heads`: ``[R, T, h, ...]`` head shard -> ``[R, T_local, W * h, ...]`` token shard."""
    rows, total, heads = y.shape[:3]
    local = total // cp.size
    send = y.reshape(rows, cp.size, local, heads, *y.shape[3:]).movedim(1, 0).contiguous()
    received = all_to_all(send, cp)  # [W (source rank = head slice), R, T_local, h, ...]
    # contiguous, as the op's own output is: callers view it (``scan_output.view(b, T, -1)``)
    return received.movedim(0, 2).reshape(rows, local, cp.size * heads, *y.shape[3:]).contiguous()


def rank_slice(tensor: Tensor | None, cp, dim: int = 0) -> Tensor | None:
    """This rank's contiguous ``1 / W`` slice of a parameter along ``dim`` (its heads' ``A``, its channels' weight)."""
    if tensor is None:
        return None
    width = tensor.shape[dim] // cp.size
    return tensor.narrow(dim, cp.rank * width, width)


def all_to_all(send: Tensor, cp) -> Tensor:
    """All-to-all over dim 0 (one entry per rank). The functional collective traces into the graph; its backward
    is the reverse all-to-all."""
    return funcol.wait_tensor(funcol.all_to_all_single(send, None, None, cp.group))


def send_forward(x: Tensor, cp, distance: int = 1) -> Tensor:
    """Cyclic shift over the group: rank ``r`` sends ``x`` to rank ``(r + distance) % W`` and returns what rank
    ``(r - distance) % W`` sent (the first ``distance`` ranks receive the last ranks' ``x``: callers mask it). One
    all-to-all with one nonzero split each way: ``x.numel()`` elements leave each rank; the backward is the reverse
    shift."""
    size = x.numel()
    sends = [size if j == (cp.rank + distance) % cp.size else 0 for j in range(cp.size)]
    receives = [size if j == (cp.rank - distance) % cp.size else 0 for j in range(cp.size)]
    received = funcol.all_to_all_single(x.reshape(-1), receives, sends, cp.group)
    return funcol.wait_tensor(received).view(x.shape)


def all_gather(x: Tensor, cp, dim: int) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order; ``(W - 1) x.numel()`` elements leave each rank.
    The backward is a reduce-scatter (each rank gets the sum of the gradients of its own part)."""
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), dim, cp.group))


def gather_tokens(x: Tensor, cp) -> Tensor:
    """``[R, T_local, ...]`` token shards of the group -> the whole rows ``[R, T, ...]``."""
    return all_gather(x, cp, dim=1)


def halo(tail: Tensor, cp) -> Tensor:
    """The last tokens ``[R, n, ...]`` of the previous rank's slice of every row (rank 0 receives the last rank's:
    the caller masks them out), for a causal conv whose window reaches across the slice start."""
    return send_forward(tail.contiguous(), cp, 1)
