"""The gradient sum over a context-parallel group, for a model without DDP / FSDP2 over the CP ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import ContextParallel


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
