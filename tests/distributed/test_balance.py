"""Packing balanced across data-parallel ranks: the cost imbalance on the benchmark's document mix, determinism,
resume, and use from a DataLoader."""

from __future__ import annotations

import pytest
import torch

from compilepack import PackedCollator
from benchmarks.data import LengthMix
from compilepack.distributed import BalancedBatchSampler, deal_by_cost, document_cost, imbalance_report

BENCH_LENGTHS = LengthMix().sample(4000, seed=0)  # the benchmark's long-tailed mix (8-1024 tokens)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_balanced_dealing_brings_the_slowest_rank_near_the_mean(ranks):
    """max / mean of the ranks' step cost: arrival-order dealing (equal document counts) vs cost-balanced dealing
    of the same steps. The full-size figures are in docs/context-parallel.md."""
    report = imbalance_report(BENCH_LENGTHS, ranks, tokens_per_rank=8192)
    assert report["before_mean"] >= 1.05, report  # the problem is real on this mix
    assert report["after_mean"] <= 1.01 and report["after_max"] <= 1.02, report


def test_every_document_is_dealt_once_per_epoch_and_ranks_share_one_plan():
    samplers = [BalancedBatchSampler(BENCH_LENGTHS, 4, rank, 8192, seed=3) for rank in range(4)]
    plan = samplers[0].plan()
    assert all(s.plan() == plan for s in samplers[1:])
    yielded = [list(iter(s)) for s in samplers]
    assert all(len(y) == len(plan) for y in yielded)
    assert sorted(i for y in yielded for step in y for i in step) == list(range(len(BENCH_LENGTHS)))
    costs = [[sum(document_cost(BENCH_LENGTHS[i], 12 * 4096) for i in y[step]) for y in yielded] for step in range(3)]
    assert all(max(c) / (sum(c) / 4) <= 1.02 for c in costs)


def test_plan_is_deterministic_per_seed_and_epoch():
    plan = BalancedBatchSampler(BENCH_LENGTHS, 2, 0, 4096, seed=1).plan
    assert plan(0) == BalancedBatchSampler(BENCH_LENGTHS, 2, 0, 4096, seed=1).plan(0)
    assert plan(0) != BalancedBatchSampler(BENCH_LENGTHS, 2, 0, 4096, seed=2).plan(0)
    assert plan(0) != plan(1)


def test_resume_continues_where_the_saved_state_stopped():
    sampler = BalancedBatchSampler(BENCH_LENGTHS, 2, 1, 4096, seed=5)
    sampler.set_epoch(2)
    iterator = iter(sampler)
    consumed = [next(iterator) for _ in range(7)]
    state = sampler.state_dict()
    rest = list(iterator)
    resumed = BalancedBatchSampler(BENCH_LENGTHS, 2, 1, 4096, seed=5)
    resumed.load_state_dict(state)
    assert state == {"epoch": 2, "step": 7, "seed": 5} and len(resumed) == len(rest)
    assert list(resumed) == rest
    assert consumed + rest == [share[1] for share in sampler.plan(2)]
    assert sampler.state_dict() == {"epoch": 3, "step": 0, "seed": 5}  # a finished epoch moves to the next
    with pytest.raises(ValueError, match="seed 5"):
        BalancedBatchSampler(BENCH_LENGTHS, 2, 1, 4096, seed=6).load_state_dict(state)


def test_cost_weighs_attention_quadratically():
    # one long document against many short ones of the same tokens: balancing tokens alone would pair them
    shares = deal_by_cost([1024] + [128] * 8, ranks=2, attention_length=1024)
    assert shares == [[0], [1, 2, 3, 4, 5, 6, 7, 8]]
    assert document_cost(1024, 1024) == 2 * 1024


def test_feeds_a_dataloader_with_a_packing_collator():
    dataset = [{"input_ids": list(range(1, n + 1))} for n in BENCH_LENGTHS[:200]]
    sampler = BalancedBatchSampler([len(d["input_ids"]) for d in dataset], 2, 0, 2048, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=PackedCollator())
    batches = list(loader)
    assert len(batches) == len(sampler.plan()) and all(b["input_ids"].shape[0] == 1 for b in batches)
