"""shard_batch on the host: each rank's slice of a packed batch (no processes needed: a ContextParallel with any
group stands for a rank of a group of W, and verify=False skips the one collective)."""

from __future__ import annotations

import pytest
import torch

from compilepack import Boundaries, PackedCollator
from compilepack.distributed import ContextParallel, ContextParallelError, shard_batch
from tests.models import hf_batch, random_docs


def _shards(batch: dict, world: int) -> list[dict]:
    return [shard_batch(batch, ContextParallel(None, world, rank), verify=False) for rank in range(world)]


def _joined(shards: list[dict], key: str) -> torch.Tensor:
    return torch.cat([s[key] for s in shards], dim=1)


@pytest.mark.parametrize("world", [2, 4])
def test_shards_join_into_the_padded_batch_with_global_boundaries(world):
    batch = hf_batch(random_docs(256, [70, 1, 23, 5, 30], seed=1))  # 129 tokens
    shards = _shards(batch, world)
    padded = -129 % world
    assert {s["input_ids"].shape for s in shards} == {(1, (129 + padded) // world)}
    assert torch.equal(_joined(shards, "input_ids")[:, :129], batch["input_ids"])
    assert torch.equal(_joined(shards, "input_ids")[:, 129:], torch.zeros(1, padded, dtype=torch.long))
    # the padding document: positions from 0, no targets; the real documents keep their positions
    assert torch.equal(_joined(shards, "position_ids"),
                       torch.cat([batch["position_ids"], torch.arange(padded)[None]], 1))
    assert (_joined(shards, "shift_labels")[:, 128:] == -100).all()
    expected = Boundaries.from_lengths([70, 1, 23, 5, 30, padded])
    for shard in shards:  # global, unsliced, the same on every rank
        assert torch.equal(shard["cu_seq_lens_q"], expected.cu_seqlens)
        assert torch.equal(shard["seq_idx"], expected.seq_idx)
        assert shard["max_length_q"] == 70


@pytest.mark.parametrize("world", [2, 4])
def test_labels_are_shifted_before_slicing(world):
    batch = hf_batch(random_docs(256, [40, 24], seed=2))  # 64 tokens: no padding
    shards = _shards(batch, world)
    local = 64 // world
    global_shift = torch.cat([batch["labels"][:, 1:], torch.tensor([[-100]])], dim=1)
    assert torch.equal(_joined(shards, "shift_labels"), global_shift)
    for rank in range(world - 1):  # a rank's last token predicts the next rank's first label
        assert shards[rank]["shift_labels"][0, -1] == batch["labels"][0, (rank + 1) * local]
    assert all(s["labels"] is s["shift_labels"] for s in shards)  # labels present, so transformers computes a loss
    # every rank divides by the whole batch's target count: the shares add up to the one-process mean
    assert {int(s["num_items_in_batch"]) for s in shards} == {int((batch["labels"][:, 1:] != -100).sum())}


def test_rows_each_get_a_padding_document_and_stay_independent():
    collate = PackedCollator(max_length=64, flatten=False)
    batch = collate([{"input_ids": d} for d in random_docs(256, [40, 30, 20, 15, 1], seed=3)])
    rows, length = batch["input_ids"].shape
    shards = _shards(batch, 4)
    padded_length = shards[0]["seq_idx"].shape[1]
    assert rows == 2 and padded_length % 4 == 0 and padded_length > length
    assert shards[0]["cu_seq_lens_q"][-1] == rows * padded_length
    for row in range(rows):  # the row's documents, then its padding document
        row_ids = _joined(shards, "input_ids")[row]
        assert torch.equal(row_ids[:length], batch["input_ids"][row])
        assert (_joined(shards, "shift_labels")[row, length - 1 :] == -100).all()
    Boundaries.from_lengths(  # documents never cross a row edge
        (shards[0]["cu_seq_lens_q"][1:] - shards[0]["cu_seq_lens_q"][:-1]).tolist(), rows=rows
    )


def test_a_divisible_batch_is_not_padded():
    batch = hf_batch(random_docs(256, [40, 24], seed=2))
    shard = _shards(batch, 4)[1]
    assert torch.equal(shard["cu_seq_lens_q"], batch["cu_seq_lens_q"])
    assert torch.equal(shard["position_ids"], batch["position_ids"][:, 16:32])


def test_a_context_parallel_model_refuses_to_be_copied():
    import copy
    import pickle

    for copy_ in (copy.deepcopy, pickle.dumps):
        with pytest.raises(ContextParallelError, match="cannot be pickled or copied"):
            copy_({"backends": ContextParallel(None, 2, 0)})


def test_refuses_batches_it_cannot_shard():
    cp = ContextParallel(None, 2, 0)
    with pytest.raises(ContextParallelError, match="needs a packed batch with boundary kwargs"):
        shard_batch({"input_ids": torch.ones(1, 8, dtype=torch.long)}, cp, verify=False)
    batch = hf_batch(random_docs(256, [4, 4]))
    batch["position_ids"] = batch["position_ids"].expand(3, 1, 8)
    with pytest.raises(ContextParallelError, match="multimodal RoPE"):
        shard_batch(batch, cp, verify=False)
    with pytest.raises(ContextParallelError, match="ProcessGroup or a 1-D DeviceMesh"):
        shard_batch(hf_batch(random_docs(256, [4, 4])), "not a group", verify=False)


@pytest.mark.parametrize("family_name", ["qwen3_5", "bamba"])
def test_a_model_patched_without_context_parallelism_runs_no_distributed_code(family_name, tmp_path):
    """Every call made during a packed forward and backward is traced: none enters compilepack/distributed/ on a
    model patched without context parallelism. Control: the same model patched with a one-rank gloo group runs
    its mixers through the collectives there."""
    import copy
    import sys

    import torch.distributed as dist

    import compilepack
    from compilepack.patching import family_named
    from tests.families import build_tiny

    def distributed_calls(model, batch) -> set[str]:
        entered = set()

        def profile(frame, event, arg):
            if event == "call" and "/compilepack/distributed/" in frame.f_code.co_filename:
                entered.add(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            model(**batch).loss.backward()
        finally:
            sys.setprofile(None)
        return entered

    torch.manual_seed(0)
    stock = build_tiny(family_named(family_name)).train()
    batch = hf_batch(random_docs(stock.config.get_text_config().vocab_size, [40, 1, 23], seed=0))
    assert distributed_calls(compilepack.patch(copy.deepcopy(stock)), batch) == set()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parallel = compilepack.patch(copy.deepcopy(stock), context_parallel=dist.group.WORLD)
        entered = distributed_calls(parallel, shard_batch(batch, dist.group.WORLD))
    finally:
        dist.destroy_process_group()
    assert {"check_batch", "split_heads", "gather_heads", "all_to_all"} <= entered, entered
