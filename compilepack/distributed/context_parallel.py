"""The context-parallel group of a patched model, and the patch-time check that its mixers can be split over it.

Ulysses context parallelism: each of W ranks holds a contiguous ``T / W`` slice of every packed row; around each
sequence-mixing op two all-to-alls (:mod:`.collectives`) turn the token shard into a head (or channel) shard of the
whole row and back. Each op's head-parallel wrapper lives beside the op (``compilepack/ops/<op>/context_parallel.py``)
and calls the op with the *global* boundaries (``cu_seqlens`` over the whole rows, ``seq_idx [R, T]``): host data
every rank already has, so nothing about the boundaries is communicated.

Parameters are replicated over the group: a rank's sliced weights (conv weight, ``A``, ``D``, ``dt_bias``) get
gradients only in its slice, and per-token weights only from its tokens; the sum of the ranks' gradients is the
one-process gradient (:func:`~compilepack.distributed.all_reduce_gradients`, or DDP / FSDP2: see
docs/context-parallel.md).
"""

from __future__ import annotations

import dataclasses
import functools

import torch.distributed as dist

from ..errors import ContextParallelError
from .collectives import head_split


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
    ranks (the ops check again at run time, including the conv channels, which only the layers know). A family's
    layers must call only replacements with a head-parallel path (``Replacement.context_parallel``)."""
    unsupported = sorted(
        {r.global_name for needed in family.layers.values() for r in needed if not r.context_parallel}
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
