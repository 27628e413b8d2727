"""FSDP2 with the sequence and hybrid modes (``worker.spawn`` runs these on W gloo processes): the parameters sharded
over all W ranks, each rank's forward on its slice, the gradient one process's. test_fsdp_modes.py asserts."""

from __future__ import annotations

import copy

import torch.distributed as dist

from tests.distributed.sequence_worker import FEW_HEADS, _amplified_convs, _without_passing, context_parallel
from tests.distributed.worker import ROW_LENGTHS, _build, _grads, _relative


def fsdp_equality(family_name: str, mode: str) -> dict:
    """The world as one context-parallel group (``mode``: ``"sequence"``, or ``"hybrid"``: Ulysses over 2 ranks,
    sequence across W / 2), the few-heads config, FSDP2 ``fully_shard`` over all W ranks (patch first, then shard):
    FSDP2 averages over W ranks, so each rank's loss share is scaled by W. Control: the same without the state pass
    and the halo."""
    import compilepack
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compilepack.distributed import shard_batch
    from tests.models import hf_batch, random_docs

    cp, world = context_parallel(mode), dist.get_world_size()
    base = _amplified_convs(_build(family_name, **FEW_HEADS[family_name]))
    batch = hf_batch(random_docs(base.config.vocab_size, ROW_LENGTHS, seed=0))
    reference = compilepack.patch(copy.deepcopy(base))
    reference(**batch).loss.backward()
    figures = {}
    for name, passing in (("grads", True), ("control_no_pass", False)):
        model = compilepack.patch(copy.deepcopy(base), context_parallel=cp)
        everyone = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=everyone)
        fully_shard(model, mesh=everyone)
        figures["sharded"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
        with _without_passing() if not passing else _nothing():
            (model(**shard_batch(batch, cp)).loss * world).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        figures[name] = _relative(grads, _grads(reference))
    return figures


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
