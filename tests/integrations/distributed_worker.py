"""torchrun worker for test_distributed.py: a compiled, patched tiny model trained one step on 2 CPU ranks (gloo).

Each rank runs a different packed batch through ``torch.compile(wrapped, backend="aot_eager")`` of a model wrapped
in DDP or sharded with FSDP2 ``fully_shard``. The loss is normalised as HF Trainer does with
``average_tokens_across_devices``: rank r's summed token loss times the world size, divided by the number of
target tokens of all ranks. DDP and FSDP2 average gradients over ranks, so the synchronised gradient is the
gradient of (sum of every rank's token losses) / (all target tokens): what one process computes over both batches.
Rank 0 writes the synchronised gradients to ``OUT/<mode>-<family>.pt``.

    torchrun --standalone --nproc_per_node=2 tests/integrations/distributed_worker.py --out DIR --cases ddp:llama
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.models

WORLD_SIZE = 2
# Rank r's documents: lengths past the mixers' 64-token chunk, 1-token documents, different counts per rank.
RANK_LENGTHS = ([70, 1, 23, 5], [12, 40, 66])


def rank_batch(rank: int, vocab_size: int) -> dict:
    from tests.models import hf_batch, random_docs

    return hf_batch(random_docs(vocab_size, list(RANK_LENGTHS[rank]), seed=100 + rank))


def target_count(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def build_patched(family_name: str) -> torch.nn.Module:
    import compilepack
    from compilepack.patching import family_named
    from tests.families import build_tiny

    torch.manual_seed(0)
    return compilepack.patch(build_tiny(family_named(family_name))).train()


def rank_loss(model, batch: dict, all_targets: int, world_size: int) -> torch.Tensor:
    from tests.models import summed_token_loss

    return summed_token_loss(model(**batch).logits, batch["labels"]) * world_size / all_targets


def _wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())  # really sharded
    return model


def run_case(mode: str, family_name: str, out: Path) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = build_patched(family_name)  # patch first: fully_shard swaps module classes, DDP wraps the model
    compiled = torch.compile(_wrap(model, mode), backend="aot_eager")
    vocab_size = model.config.vocab_size
    all_targets = sum(target_count(rank_batch(r, vocab_size)) for r in range(WORLD_SIZE))
    rank_loss(compiled, rank_batch(rank, vocab_size), all_targets, WORLD_SIZE).backward()
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        if hasattr(grad, "full_tensor"):  # FSDP2: a sharded DTensor; gathering is a collective on every rank
            grad = grad.full_tensor()
        grads[name] = grad.detach().clone()
    if rank == 0:
        torch.save(grads, out / f"{mode}-{family_name}.pt")
    dist.barrier()


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True, help="comma-separated mode:family, mode in {ddp, fsdp2}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        assert dist.get_world_size() == WORLD_SIZE, dist.get_world_size()
        for case in args.cases.split(","):
            mode, family_name = case.split(":")
            run_case(mode, family_name, args.out)
            torch._dynamo.reset()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
