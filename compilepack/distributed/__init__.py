"""Distributed training of packed rows: the context-parallel group and its collectives, batch sharding, packing
balanced across data-parallel ranks, and the gradient sum.

    cp = dist.new_group(...)                                    # or mesh["cp"]
    model = compilepack.patch(model, context_parallel=cp)       # before torch.compile / fully_shard
    out = model(**compilepack.distributed.shard_batch(batch, cp))

Each op's context-parallel wrapper lives beside the op (``compilepack/ops/<op>/sharded.py``); a model
patched without context parallelism never runs code of this package. See docs/context-parallel.md.
"""

from ..errors import ContextParallelError
from .balance import BalancedBatchSampler, deal_by_cost, document_cost, imbalance_report
from .group import ContextParallel
from .gradients import all_reduce_gradients
from .sharding import shard_batch

__all__ = [
    "BalancedBatchSampler",
    "ContextParallel",
    "ContextParallelError",
    "all_reduce_gradients",
    "deal_by_cost",
    "document_cost",
    "imbalance_report",
    "shard_batch",
]
