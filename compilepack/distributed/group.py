"""The context-parallel group of a patched model, and the patch-time check that its mixers can be split over it.

Each of W ranks holds a contiguous ``T / W`` slice of every packed row, in every mode; the modes differ in how the
sequence mixers see the whole row:

- **Ulysses** (the default): around each sequence-mixing op two all-to-alls (:mod:`.collectives`) turn the token
  shard into a head (or channel) shard of the whole row and back; W is bounded by the head counts.
- **Sequence** (:meth:`ContextParallel.sequence_parallel`): every mixer runs on the rank's slice: attention against
  the all-gathered keys and values, causal conv1d with a halo of ``kernel - 1`` tokens from the previous rank, the
  linear mixers from the state the previous ranks pass on (:mod:`.scan`); W is bounded by the tokens.
- **Hybrid** (:meth:`ContextParallel.hybrid`): Ulysses inside groups of U ranks (U at most the head counts),
  sequence across the S = W / U groups; W = U x S. Rank ``s * U + u`` holds slice ``s * U + u`` of every row, so the
  batch is sharded exactly as in the other modes.

Each op's wrappers live beside the op (``compilepack/ops/<op>/sharded.py``) and use the *global* boundaries
(``cu_seqlens`` over the whole rows, ``seq_idx [R, T]``): host data every rank already has, so nothing about the
boundaries is communicated.

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


ULYSSES, SEQUENCE, HYBRID = "ulysses", "sequence", "hybrid"
HYBRID_DIMS = ("sequence", "ulysses")  # a 2-D DeviceMesh with these dimension names selects the hybrid layout


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The context-parallel group of this process (all W ranks: the batch's slices, the gradient sum) and how its
    mixers split the work (``mode``: ``"ulysses"``, ``"sequence"`` or ``"hybrid"``).

    Hashable and compared by its fields, so it can sit in :class:`compilepack.Backends` (patched forwards are cached
    per backends). Build one with :meth:`of` (Ulysses, or a hybrid 2-D mesh), :meth:`sequence_parallel` or
    :meth:`hybrid`; pass the same object to ``compilepack.patch(model, context_parallel=cp)`` and to
    ``shard_batch(batch, cp)``.
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    mode: str = ULYSSES
    # hybrid: this rank's Ulysses group (U ranks, one slice of S) and its sequence group (S ranks, one per slice)
    ulysses_part: ContextParallel | None = None
    sequence_part: ContextParallel | None = None
    # how the linear mixers' states cross the ranks (sequence and hybrid): "auto", "sequential" or "log" (scan.py)
    state_pass: str = "auto"

    @classmethod
    def of(cls, group_or_mesh) -> ContextParallel:
        """From a process group or a 1-D ``DeviceMesh`` (Ulysses; for a multi-dimensional mesh pass its CP dimension,
        ``mesh["cp"]``), or a 2-D ``DeviceMesh`` whose dimensions are named ``("sequence", "ulysses")`` (hybrid, see
        :meth:`hybrid`); a ``ContextParallel`` is returned as it is. One object per group in a process: the model
        and every batch sharded for it hold the very same object, which the patched forwards check by identity (a
        static fact, free inside a graph)."""
        if isinstance(group_or_mesh, ContextParallel):
            return group_or_mesh
        if _is_mesh(group_or_mesh) and group_or_mesh.ndim == 2 and group_or_mesh.mesh_dim_names == HYBRID_DIMS:
            return cls.hybrid(group_or_mesh)
        return _of_group(_group(group_or_mesh, "context_parallel="))

    @classmethod
    def sequence_parallel(cls, group_or_mesh, *, state_pass: str = "auto") -> ContextParallel:
        """Context parallelism over tokens on a process group or 1-D ``DeviceMesh``: each rank runs every mixer on
        its own slice of each row (gathered keys for attention, a halo for the conv, state passing for the linear
        mixers), so W is bounded by the tokens, not the heads. ``state_pass``: ``"sequential"``, ``"log"`` or
        ``"auto"`` (see :mod:`compilepack.distributed.scan`).

        Example::

            cp = ContextParallel.sequence_parallel(dist.group.WORLD)   # W = 8 with 2 query heads is fine
            model = compilepack.patch(model, context_parallel=cp)
            out = model(**shard_batch(batch, cp))
        """
        _check_state_pass(state_pass)
        return _sequence_of_group(_group(group_or_mesh, "ContextParallel.sequence_parallel"), state_pass)

    @classmethod
    def hybrid(cls, mesh=None, *, ulysses=None, sequence=None, group=None, state_pass: str = "auto"
               ) -> ContextParallel:
        """Ulysses inside groups of U ranks, sequence-parallel across the S = W / U groups (W = U x S): the heads are
        split U ways (U at most the head counts), the tokens S ways.

        Either a 2-D ``DeviceMesh`` with dimensions named ``("sequence", "ulysses")`` (the Ulysses dimension inner:
        ``init_device_mesh("cuda", (S, U), mesh_dim_names=("sequence", "ulysses"))``, or that sub-mesh of a larger
        mesh, ``mesh["sequence", "ulysses"]``), or three process groups: ``ulysses`` (this rank's U ranks),
        ``sequence`` (its S ranks) and ``group`` (all W, ranked ``s * U + u``).

        Example::

            mesh = init_device_mesh("cuda", (4, 2), mesh_dim_names=("sequence", "ulysses"))   # W = 8, U = 2
            cp = ContextParallel.hybrid(mesh)            # or compilepack.patch(model, context_parallel=mesh)
            model = compilepack.patch(model, context_parallel=cp)
            out = model(**shard_batch(batch, cp))
        """
        _check_state_pass(state_pass)
        if mesh is not None:
            if not (_is_mesh(mesh) and mesh.ndim == 2 and mesh.mesh_dim_names == HYBRID_DIMS):
                raise ContextParallelError(
                    "ContextParallel.hybrid(mesh) needs a 2-D DeviceMesh with dimensions named ('sequence', "
                    f"'ulysses') (the Ulysses dimension inner), got {_describe_mesh(mesh)}."
                )
            return _hybrid_of_mesh(mesh, state_pass)
        if ulysses is None or sequence is None or group is None:
            raise ContextParallelError(
                "ContextParallel.hybrid needs a 2-D DeviceMesh named ('sequence', 'ulysses'), or all three process "
                "groups: ulysses=, sequence= and group= (all the ranks)."
            )
        return _hybrid_of_groups(*(_group(g, "ContextParallel.hybrid") for g in (ulysses, sequence, group)),
                                 state_pass)

    @property
    def heads(self) -> ContextParallel | None:
        """The group the mixers' heads are split over (Ulysses), or None (sequence mode)."""
        return self if self.mode == ULYSSES else self.ulysses_part

    @property
    def tokens(self) -> ContextParallel | None:
        """The group the mixers' tokens are split over (sequence and hybrid modes), or None (Ulysses)."""
        return self if self.mode == SEQUENCE else self.sequence_part

    def describe(self) -> str:
        """Every field that changes what the mixers run: patched forwards are installed under a name derived from
        it (``patching.family._key``), so two groups, or two state passes on one group, never share one."""
        where = f"rank={self.rank}, group={id(self.group):x}"
        if self.mode == HYBRID:
            return (f"hybrid(ulysses={self.ulysses_part.size} x sequence={self.sequence_part.size}, "
                    f"state_pass={self.state_pass}, {where})")
        if self.mode == SEQUENCE:
            return f"sequence(size={self.size}, state_pass={self.state_pass}, {where})"
        return f"{self.mode}(size={self.size}, {where})"

    def __reduce__(self):
        # a process group lives in this process only: say so, instead of pickle's "cannot pickle ProcessGroup"
        raise ContextParallelError(
            "a model patched with context_parallel= cannot be pickled or copied (its process group belongs to this "
            "process): copy or save the model before compilepack.patch, or compilepack.unpatch it first."
        )


@functools.cache
def _of_group(group: dist.ProcessGroup) -> ContextParallel:
    return ContextParallel(group, dist.get_world_size(group), dist.get_rank(group))


@functools.cache
def _sequence_of_group(group: dist.ProcessGroup, state_pass: str) -> ContextParallel:
    return ContextParallel(group, dist.get_world_size(group), dist.get_rank(group), SEQUENCE, state_pass=state_pass)


@functools.cache
def _hybrid_of_mesh(mesh, state_pass: str) -> ContextParallel:
    # the whole group: the mesh flattened, row-major over (sequence, ulysses), so rank s * U + u (a private torch
    # API: DeviceMesh has no public one for it in torch 2.13)
    return _hybrid_of_groups(mesh.get_group("ulysses"), mesh.get_group("sequence"), mesh._flatten().get_group(),
                             state_pass)


@functools.cache
def _hybrid_of_groups(ulysses: dist.ProcessGroup, sequence: dist.ProcessGroup, group: dist.ProcessGroup,
                      state_pass: str) -> ContextParallel:
    heads = ContextParallel(ulysses, dist.get_world_size(ulysses), dist.get_rank(ulysses))
    tokens = ContextParallel(sequence, dist.get_world_size(sequence), dist.get_rank(sequence), SEQUENCE,
                             state_pass=state_pass)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != heads.size * tokens.size or rank != tokens.rank * heads.size + heads.rank:
        raise ContextParallelError(
            f"ContextParallel.hybrid: rank {rank} of a group of {size} must be rank {tokens.rank} of its sequence "
            f"group (of {tokens.size}) times the Ulysses size {heads.size} plus its rank {heads.rank} in the Ulysses "
            "group: the Ulysses groups hold consecutive slices of every row. Build the groups from a DeviceMesh "
            "named ('sequence', 'ulysses')."
        )
    return ContextParallel(group, size, rank, HYBRID, heads, tokens, state_pass)


def _is_mesh(value) -> bool:
    return hasattr(value, "get_group") and hasattr(value, "ndim")


def _describe_mesh(value) -> str:
    if not _is_mesh(value):
        return type(value).__name__
    return f"a {value.ndim}-D DeviceMesh named {value.mesh_dim_names}"


def _group(group_or_mesh, where: str) -> dist.ProcessGroup:
    """The process group of a group or 1-D ``DeviceMesh``."""
    group = group_or_mesh
    if _is_mesh(group_or_mesh):
        if group_or_mesh.ndim != 1:
            raise ContextParallelError(
                f"{where} got a {group_or_mesh.ndim}-D DeviceMesh; pass its context-parallel dimension, e.g. "
                "mesh['cp'] (or, for the hybrid layout, a 2-D mesh named ('sequence', 'ulysses'))."
            )
        group = group_or_mesh.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise ContextParallelError(
            f"{where} must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got {type(group_or_mesh).__name__}."
        )
    return group


def _check_state_pass(state_pass: str) -> None:
    from .scan import SCHEDULES

    if state_pass not in SCHEDULES:
        raise ContextParallelError(f"state_pass must be one of {SCHEDULES}, got {state_pass!r}.")


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
    """Refuse, at ``patch()`` time, a model whose family or head counts Ulysses cannot split over its ranks
    (``cp.size``; the Ulysses size in the hybrid layout; no head count bounds the sequence mode). The ops check again
    at run time, including the conv channels and the conv window against the slice, which only the layers know. A
    family's layers must call only replacements with a context-parallel path (``Replacement.runs_sharded``)."""
    unsupported = sorted(
        {r.global_name for needed in family.layers.values() for r in needed if not r.runs_sharded}
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
    if cp.heads is None:
        return
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for heads_name, read_name in CONFIG_HEADS:
        heads, read = getattr(config, heads_name, None), getattr(config, read_name, None)
        if isinstance(heads, int) and isinstance(read, int):
            head_split(heads, read, cp.heads.size, f"{family.name} config", heads_name, read_name)
