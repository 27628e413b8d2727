"""Ulysses context parallelism: each of W ranks holds a contiguous ``T / W`` slice of every packed row; around each
sequence-mixing op two all-to-alls turn the token shard into a head (or channel) shard of the whole row and back.

The op in the middle is compilepack's own boundary-aware op, called with the *global* boundaries (``cu_seqlens``
over the whole rows, ``seq_idx [R, T]``): host data every rank already has, so nothing about the boundaries is
communicated. Only activations travel, through the functional collective ``all_to_all_single``, which
``torch.compile(fullgraph=True)`` keeps in the graph and whose backward is the reverse all-to-all.

Layout of a shard: ``[R, T_local, heads, ...]`` (tokens first, as transformers' projections are). Rank ``j`` of the
group holds tokens ``j * T_local : (j + 1) * T_local`` of every row. How each op is split (the sizes that must
divide by W are checked by :func:`head_split`, which names them when they do not):

- attention: query heads split in W contiguous slices; key/value heads split alike when W divides them, else
  (fewer kv heads than W, W a multiple of them) each rank receives the one kv head its query heads read: kv heads
  are *replicated*, as Megatron and DeepSpeed Ulysses do;
- causal conv1d: channels split in W contiguous slices (depthwise: each rank convolves its channels with its
  slice of the weight and bias);
- gated delta rule / Kimi delta attention: value heads split in W slices; query/key heads split alike when W
  divides them, else each rank receives the one q/k head its value heads read (``num_k_heads <= num_v_heads``);
- Mamba2 SSD scan: heads split (with their ``A``, ``D``, ``dt_bias``); B/C groups split when W divides them, else
  replicated (one group per rank). The gated norm after the scan runs per token on the token shard: no split.

Parameters are replicated over the group: a rank's sliced weights (conv weight, ``A``, ``D``, ``dt_bias``) get
gradients only in its slice, and per-token weights only from its tokens; the sum of the ranks' gradients is the
one-process gradient (see ``docs/context-parallel.md`` for who sums them).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import CompilepackError


# the batch key shard_batch sets: the ContextParallel the batch was sharded for
SHARD_KEY = "context_parallel_shard"


class ContextParallelError(CompilepackError, ValueError):
    """A model or batch that cannot run under the requested context parallelism."""


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The context-parallel group of this process: every op's all-to-all runs over ``group``.

    Hashable and compared by group, size and rank, so it can sit in :class:`compilepack.Backends` (patched forwards
    are cached per backends).
    """

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group_or_mesh) -> ContextParallel:
        """From a process group or a 1-D ``DeviceMesh`` (for a multi-dimensional mesh pass its CP dimension,
        ``mesh["cp"]``). One object per group in a process: the model and every batch sharded for it hold the very
        same object, which the patched forwards check by identity (a static fact, free inside a graph)."""
        if isinstance(group_or_mesh, ContextParallel):
            return group_or_mesh
        group = group_or_mesh
        if hasattr(group_or_mesh, "get_group"):  # a DeviceMesh
            if group_or_mesh.ndim != 1:
                raise ContextParallelError(
                    f"context_parallel= got a {group_or_mesh.ndim}-D DeviceMesh; pass its context-parallel "
                    "dimension, e.g. mesh['cp']."
                )
            group = group_or_mesh.get_group()
        if not isinstance(group, dist.ProcessGroup):
            raise ContextParallelError(
                f"context_parallel= must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got "
                f"{type(group_or_mesh).__name__}."
            )
        return _of_group(group)

    def describe(self) -> str:
        return f"ulysses(size={self.size}, rank={self.rank}, group={id(self.group):x})"

    def __reduce__(self):
        # a process group lives in this process only: say so, instead of pickle's "cannot pickle ProcessGroup"
        raise ContextParallelError(
            "a model patched with context_parallel= cannot be pickled or copied (its process group belongs to this "
            "process): copy or save the model before compilepack.patch, or compilepack.unpatch it first."
        )


@functools.cache
def _of_group(group: dist.ProcessGroup) -> ContextParallel:
    return ContextParallel(group, dist.get_world_size(group), dist.get_rank(group))


# ------------------------------------------------------------------------------------------------ splitting heads


def head_split(heads: int, read_heads: int, size: int, where: str, heads_name: str, read_name: str) -> int:
    """How many of ``read_heads`` (kv heads, q/k heads, B/C groups) each rank receives when ``heads`` (the heads
    the op outputs: query heads, value heads, SSM heads) are split in ``size`` contiguous slices.

    ``heads`` must divide by ``size``. ``read_heads`` are split alike when they divide by ``size``; when fewer, and
    ``size`` is a multiple of them, each rank receives the one read head its slice of ``heads`` reads (replicated).
    """
    if heads % size:
        raise ContextParallelError(
            f"{where}: {heads_name}={heads} does not divide by the context-parallel size {size}; Ulysses splits "
            f"{heads_name} across ranks, so {heads_name} must be a multiple of {size} (use a context-parallel size "
            "that divides it)."
        )
    if read_heads % size == 0:
        return read_heads // size
    if size % read_heads == 0:
        return 1
    raise ContextParallelError(
        f"{where}: {read_name}={read_heads} and the context-parallel size {size} do not divide one another; "
        f"{read_name} must be a multiple of {size} (split across ranks) or divide {size} (replicated)."
    )


def split_heads(x: Tensor, cp: ContextParallel) -> Tensor:
    """``[R, T_local, H, ...]`` token shard -> ``[R, T, H / W, ...]`` head shard of the whole rows."""
    rows, local, heads = x.shape[:3]
    send = x.reshape(rows, local, cp.size, heads // cp.size, *x.shape[3:]).movedim(2, 0).contiguous()
    received = _all_to_all(send, cp)  # [W (source rank = token slice), R, T_local, H / W, ...]
    return received.movedim(0, 1).reshape(rows, cp.size * local, heads // cp.size, *x.shape[3:]).contiguous()


def split_read_heads(x: Tensor, cp: ContextParallel, per_rank: int) -> Tensor:
    """Like :func:`split_heads` for heads that other heads read (kv heads, q/k heads, groups): when ``per_rank`` is
    1 and there are fewer heads than ranks, each head is repeated for the ranks whose slice reads it."""
    heads = x.shape[2]
    if heads == per_rank * cp.size:
        return split_heads(x, cp)
    return split_heads(x.repeat_interleave(cp.size // heads, dim=2), cp)


def gather_heads(y: Tensor, cp: ContextParallel) -> Tensor:
    """Inverse of :func:`split_heads`: ``[R, T, h, ...]`` head shard -> ``[R, T_local, W * h, ...]`` token shard."""
    rows, total, heads = y.shape[:3]
    local = total // cp.size
    send = y.reshape(rows, cp.size, local, heads, *y.shape[3:]).movedim(1, 0).contiguous()
    received = _all_to_all(send, cp)  # [W (source rank = head slice), R, T_local, h, ...]
    # contiguous, as the op's own output is: callers view it (``scan_output.view(b, T, -1)``)
    return received.movedim(0, 2).reshape(rows, local, cp.size * heads, *y.shape[3:]).contiguous()


def rank_slice(tensor: Tensor | None, cp: ContextParallel, dim: int = 0) -> Tensor | None:
    """This rank's contiguous ``1 / W`` slice of a parameter along ``dim`` (its heads' ``A``, its channels' weight)."""
    if tensor is None:
        return None
    width = tensor.shape[dim] // cp.size
    return tensor.narrow(dim, cp.rank * width, width)


def _all_to_all(send: Tensor, cp: ContextParallel) -> Tensor:
    """All-to-all over dim 0 (one entry per rank). The functional collective traces into the graph; its
    backward is the reverse all-to-all."""
    from torch.distributed import _functional_collectives as funcol

    received = funcol.all_to_all_single(send, None, None, cp.group)
    return funcol.wait_tensor(received)


def check_batch(kwargs: dict, cp: ContextParallel | None, where: str) -> None:
    """Refuse a packed batch that was not sharded for this model's context parallelism: unsharded under CP,
    sharded without CP, or sharded for another group or rank. Compares Python objects only (the batch's
    ``context_parallel`` entry with the model's, by identity): free inside a graph, where it becomes a guard."""
    shard = kwargs.get(SHARD_KEY)
    if shard is cp:
        return
    if cp is None:
        raise ContextParallelError(
            f"{where}: the batch was sharded for context parallelism (it has '{SHARD_KEY}') but the model was patched "
            "without it; patch with compilepack.patch(model, context_parallel=group), or pass the unsharded batch."
        )
    if shard is None:
        raise ContextParallelError(
            f"{where}: the model runs context-parallel over {cp.size} ranks but the batch was not sharded; pass "
            f"compilepack.distributed.shard_batch(batch, group) (each rank keeps 1/{cp.size} of every row)."
        )
    raise ContextParallelError(
        f"{where}: the batch was sharded for {shard.describe()} but the model runs {cp.describe()}; shard with the "
        "group the model was patched with."
    )


def check_shard(local: int, global_: int, cp: ContextParallel, where: str) -> None:
    """Refuse a batch whose local length times W is not the length the global boundaries describe: a batch that
    was not sharded (or was sharded for another group size). Static shapes only: safe to trace."""
    if local * cp.size != global_:
        raise ContextParallelError(
            f"{where}: this rank holds {local} tokens per row but the boundaries (seq_idx) describe rows of "
            f"{global_}; under context parallelism of size {cp.size} each rank must hold exactly 1/{cp.size} of "
            "every row. Shard every batch with compilepack.distributed.shard_batch(batch, group)."
        )


# ------------------------------------------------------------------------------------------------ the ops under CP


def attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, global_length: int,
    cp: ContextParallel, where: str, **op_kwargs,
) -> Tensor:
    """``compilepack.ops.varlen_attention`` on a token shard: ``[R, H, T_local, D]`` query/key/value (the layout
    transformers' attention functions receive) -> ``[R, T_local, H, Dv]``. ``cu_seqlens`` and ``max_seqlen`` are
    the global boundaries over ``R`` rows of ``global_length`` tokens; ``op_kwargs`` go to the op."""
    from ..ops.attention import varlen_attention

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


def causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor, activation: str | None, *, backend: str,
    cp: ContextParallel,
) -> Tensor:
    """``compilepack.ops.causal_conv1d_varlen`` on a token shard ``x [R, C, T_local]`` with the global
    ``seq_idx [R, T]``: each rank convolves ``C / W`` channels of the whole rows with its slice of the weight."""
    from ..ops.causal_conv1d import causal_conv1d_varlen

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


def delta_rule(
    varlen, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, *, cp: ContextParallel,
    where: str, **op_kwargs,
) -> Tensor:
    """A delta-rule op (``gated_delta_rule_varlen``, ``kimi_delta_attention_varlen``) on a token shard
    (``[R, T_local, heads, ...]``) with the global ``cu_seqlens``: each rank runs ``HV / W`` value heads (their
    ``g``, ``beta``) and the q/k heads they read, over the whole rows."""
    per_rank = head_split(v.shape[2], q.shape[2], cp.size, where, "linear_num_value_heads", "linear_num_key_heads")
    q, k = (split_read_heads(x, cp, per_rank) for x in (q, k))
    v, g, beta = (split_heads(x, cp) for x in (v, g, beta))
    return gather_heads(varlen(q, k, v, g, beta, cu_seqlens, **op_kwargs), cp)


def mamba2_chunk_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
    *, seq_idx: Tensor, backend: str, cp: ContextParallel,
) -> Tensor:
    """``compilepack.ops.mamba2_chunk_scan_varlen`` on a token shard ``x [R, T_local, H, P]`` with the global
    ``seq_idx [R, T]``: each rank scans ``H / W`` heads (their ``dt``, ``A``, ``D``, ``dt_bias``) and the B/C
    groups they read, over the whole rows."""
    from ..ops.mamba2 import mamba2_chunk_scan_varlen

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


# ------------------------------------------------------------------------------------------------ patch-time checks

# The global kernel replacements whose packed path runs head- or channel-parallel under CP (replacements.py); a
# family whose layers need another (the Mamba1 selective scan) is refused.
SUPPORTED_REPLACEMENTS = frozenset({
    "ALL_ATTENTION_FUNCTIONS", "causal_conv1d_fn", "torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention",
    "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined",
})

# (heads the op outputs, heads those read) as the families' configs name them; checked when the config has both.
CONFIG_HEADS = (
    ("num_attention_heads", "num_key_value_heads"),
    ("linear_num_value_heads", "linear_num_key_heads"),
    ("linear_num_heads", "linear_num_heads"),
    ("mamba_n_heads", "mamba_n_groups"),
    ("mamba_num_heads", "n_groups"),
    ("n_mamba_heads", "mamba_ngroups"),
)


def check_model(model, family, cp: ContextParallel) -> None:
    """Refuse, at ``patch()`` time, a model whose family or head counts Ulysses cannot split over ``cp.size``
    ranks (the ops check again at run time, including the conv channels, which only the layers know)."""
    unsupported = sorted(
        {r.global_name for needed in family.layers.values() for r in needed} - SUPPORTED_REPLACEMENTS
    )
    if unsupported or family.boundary_calls:
        why = (
            f"its layers call {', '.join(unsupported)} (no head-parallel path)" if unsupported else
            "its model forwards drop **kwargs on the way to the mixers, and the calls compilepack threads carry the "
            "boundaries only (not the batch's shard, shift_labels or num_items_in_batch)"
        )
        raise ContextParallelError(
            f"context parallelism does not support {family.name} yet: {why}. Supported: families made of "
            "attention, causal conv1d, Gated DeltaNet, Kimi delta attention and Mamba2 layers whose stacks pass "
            "**kwargs down (docs/context-parallel.md)."
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for heads_name, read_name in CONFIG_HEADS:
        heads, read = getattr(config, heads_name, None), getattr(config, read_name, None)
        if isinstance(heads, int) and isinstance(read, int):
            head_split(heads, read, cp.size, f"{family.name} config", heads_name, read_name)


# ------------------------------------------------------------------------------------------------ gradients


def all_reduce_gradients(model: torch.nn.Module, group_or_mesh) -> None:
    """Sum every parameter's gradient over the context-parallel group, after ``loss.backward()`` on each rank.

    Each rank's loss is its tokens' share (``shard_batch`` sets ``num_items_in_batch`` to the whole batch's target
    count), so the sum over the group is the one-process gradient. For a model without DDP / FSDP2 over the CP
    ranks; with them, scale the loss by the group size instead (they average; see docs/context-parallel.md).
    """
    cp = ContextParallel.of(group_or_mesh)
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=cp.group)


# ------------------------------------------------------------------------------------------------ the decoder


def shards_per_row(kwargs: dict, tokens: Tensor) -> int:
    """For the patched decoder's boundary checks: how many ranks share each row (1 without a shard).

    A context-parallel shard holds ``T / W`` tokens of every row while its ``seq_idx`` and ``cu_seq_lens_q``
    describe the whole rows (``shard_batch``): the boundary checks run on the whole rows (``T = W x T_local``).
    Static facts only: safe to trace."""
    shard = kwargs.get(SHARD_KEY)
    if shard is None:
        return 1
    if kwargs.get("position_ids") is None:
        raise ContextParallelError(
            "a context-parallel shard needs its 'position_ids' (positions inside each document, global: they cannot "
            "be derived from a slice of a row); shard with compilepack.distributed.shard_batch, which sets them."
        )
    seq_idx = kwargs.get("seq_idx")
    if isinstance(seq_idx, Tensor) and seq_idx.dim() == 2:  # (otherwise the static checks refuse it themselves)
        check_shard(tokens.shape[1], seq_idx.shape[1], shard, "the packed decoder")
    return shard.size
