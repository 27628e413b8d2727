"""Packing balanced across data-parallel ranks: the cost imbalance on the benchmark's document mix, determinism,
resume, and use from a DataLoader."""

from __future__ import annotations

import random

import pytest
import torch

from compilepack import PackedCollator
from compilepack.distributed import BalancedBatchSampler, deal_by_cost, document_cost, imbalance_report


def long_tailed_lengths(count: int, seed: int) -> list[int]:
    """An SFT-like long-tailed mix, as the benchmark samples it: lognormal lengths (median ~90) clipped to 8-1024."""
    generator = random.Random(seed)
    return [max(8, min(1024, round(generator.lognormvariate(4.5, 1.0)))) for _ in range(count)]


BENCH_LENGTHS = long_tailed_lengths(4000, seed=0)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_balanced_dealing_brings_the_slowest_rank_near_the_mean(ranks):
    """max / mean of the ranks' step cost: arrival-order dealing (equal document counts) vs cost-balanced dealing
    of the same steps. The full-size figures are in docs/context-parallel-evidence.md."""
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


def _dataset(count: int = 300) -> list[dict]:
    """Items whose tokens name their index (token ``index % 250 + 1``, repeated to the item's length)."""
    return [{"input_ids": [index % 250 + 1] * n} for index, n in enumerate(BENCH_LENGTHS[:count])]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_through_its_loader_continues_exactly_whatever_the_workers_draw_ahead(workers):
    """Through ``sampler.loader`` the state counts the batches the loop took, not the ones the workers drew: with
    2 workers the sampler has yielded 4 steps ahead after 3 taken (prefetch 2 x 2). A new sampler loaded with that
    state yields the same batches the first one goes on to yield."""
    dataset = _dataset()
    lengths = [len(d["input_ids"]) for d in dataset]
    sampler = BalancedBatchSampler(lengths, 2, 1, 2048, seed=5)
    sampler.set_epoch(2)
    options = dict(collate_fn=PackedCollator(), num_workers=workers)
    batches = iter(sampler.loader(dataset, **options))
    taken = [next(batches) for _ in range(3)]
    state = sampler.state_dict()
    assert (state["epoch"], state["step"]) == (2, 3)
    rest = list(batches)
    resumed = BalancedBatchSampler(lengths, 2, 1, 2048, seed=5)
    resumed.load_state_dict(state)
    again = list(resumed.loader(dataset, **options))
    assert len(again) == len(rest) == len(sampler.plan(2)) - 3
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(again, rest))
    assert taken[0]["input_ids"].numel() > 0
    assert (sampler.state_dict()["epoch"], sampler.state_dict()["step"]) == (3, 0)  # a finished epoch moves on


def test_a_plain_dataloader_cannot_be_counted_so_state_dict_refuses_unless_told_the_step():
    """A DataLoader built around the sampler draws ahead (here 4 steps after 2 taken): refused, with the fix; given
    the steps taken, the state resumes exactly. Iterating the sampler itself through ``track`` is counted."""
    dataset = _dataset()
    lengths = [len(d["input_ids"]) for d in dataset]
    sampler = BalancedBatchSampler(lengths, 2, 0, 2048, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=PackedCollator(), num_workers=2)
    batches = iter(loader)
    taken = [next(batches) for _ in range(2)]
    with pytest.raises(ValueError, match=r"sampler.loader\(dataset, ...\) or sampler.track\(loader\)"):
        sampler.state_dict()
    state = sampler.state_dict(step=len(taken))
    rest = list(batches)
    resumed = BalancedBatchSampler(lengths, 2, 0, 2048, seed=1)
    resumed.load_state_dict(state)
    resumed_batches = resumed.loader(dataset, collate_fn=PackedCollator())
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed_batches, rest))
    own = BalancedBatchSampler(lengths, 2, 0, 2048, seed=1)
    counted = own.track(own)
    first = [next(counted) for _ in range(4)]
    assert own.state_dict()["step"] == 4 and first == [share[0] for share in own.plan()[:4]]


def test_a_state_from_a_sampler_with_other_settings_is_refused():
    sampler = BalancedBatchSampler(BENCH_LENGTHS, 2, 1, 4096, seed=5)
    state = sampler.state_dict(step=3)
    BalancedBatchSampler(BENCH_LENGTHS, 2, 0, 4096, seed=5).load_state_dict(state)  # another rank: the same plan
    with pytest.raises(ValueError, match="seed 5"):
        BalancedBatchSampler(BENCH_LENGTHS, 2, 1, 4096, seed=6).load_state_dict(state)
    for other in (dict(num_replicas=4), dict(tokens_per_rank=2048), dict(drop_last=True), dict(shuffle=False)):
        settings = {"lengths": BENCH_LENGTHS, "num_replicas": 2, "rank": 1, "tokens_per_rank": 4096, "seed": 5, **other}
        with pytest.raises(ValueError, match=f"other settings \\({next(iter(other))}: saved"):
            BalancedBatchSampler(**settings).load_state_dict(state)
    with pytest.raises(ValueError, match=r"other settings \(documents: saved 4000, now 3999; lengths_sha1"):
        BalancedBatchSampler(BENCH_LENGTHS[:-1], 2, 1, 4096, seed=5).load_state_dict(state)


def test_negative_or_non_integer_lengths_are_refused():
    with pytest.raises(ValueError, match=r"lengths\[2\] = -1: every length must be an int >= 0"):
        BalancedBatchSampler([3, 4, -1], 2, 0, 16)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 2.5"):
        BalancedBatchSampler([2.5, 4], 2, 0, 16)


@pytest.mark.parametrize("lengths, tokens_per_rank", [
    ([30, 25, 20, 18, 16, 12, 10, 8, 5], 40),  # 9 documents on 4 ranks: the last step would hold 1 or 2
    ([900, 20, 15, 10, 9, 8, 7, 6, 5], 64),  # one document far longer than tokens_per_rank
], ids=["nine_documents", "one_over_budget"])
def test_every_rank_gets_a_document_in_every_step_on_four_ranks(lengths, tokens_per_rank, recwarn):
    """No rank is ever left without a batch (its collator would raise while the others wait at the first
    collective): the leftovers of an epoch join the last full step; every document is dealt once; and a document
    over the per-rank budget is warned about."""
    samplers = [BalancedBatchSampler(lengths, 4, rank, tokens_per_rank, seed=0) for rank in range(4)]
    plan = samplers[0].plan()
    assert plan and all(all(share) for share in plan), plan
    assert sorted(i for share in plan for rank in share for i in rank) == list(range(len(lengths)))
    for sampler in samplers:
        for batch in sampler.loader([{"input_ids": [1] * n} for n in lengths], collate_fn=PackedCollator()):
            assert batch["input_ids"].numel() > 0
    over = [str(w.message) for w in recwarn if "longer than tokens_per_rank" in str(w.message)]
    assert bool(over) == (max(lengths) > tokens_per_rank), over
    dropped = BalancedBatchSampler(lengths, 4, 0, tokens_per_rank, seed=0, drop_last=True).plan()
    assert all(all(share) for share in dropped) and len(dropped) <= len(plan)


def test_an_epoch_with_fewer_documents_than_ranks_has_no_step_on_any_rank():
    with pytest.warns(UserWarning, match="2 non-empty document\\(s\\) for 4 ranks: no step"):
        plans = [BalancedBatchSampler([5, 0, 7], 4, rank, 64).plan() for rank in range(4)]
    assert plans == [[]] * 4


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
