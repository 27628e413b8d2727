"""Context parallelism (Ulysses) for packed rows, batch sharding and packing balanced across ranks.

    cp = dist.new_group(...)                                    # or mesh["cp"]
    model = compilepack.patch(model, context_parallel=cp)       # before torch.compile / fully_shard
    out = model(**compilepack.distributed.shard_batch(batch, cp))

See docs/context-parallel.md.
"""

from .balance import BalancedBatchSampler, deal_by_cost, document_cost, imbalance_report
from .sharding import shard_batch
from .ulysses import ContextParallel, ContextParallelError, all_reduce_gradients

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
