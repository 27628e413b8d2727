"""Packing balanced across data-parallel ranks: every rank's share of a step costs about the same.

A synchronous step lasts as long as its slowest rank. Dealing documents to ranks in arrival order (a
``DistributedSampler`` with a per-rank batch size) gives one rank the long documents of a step and another the
short ones: with long-tailed lengths the most loaded rank carries ~1.3-1.5x the mean (measured below). The
:class:`BalancedBatchSampler` looks at the whole next step of every rank (a global view, the same on every rank:
same seed, same plan), and deals its documents by cost, longest-processing-time first (each document, costliest
first, to the rank with the least cost so far): the classic greedy whose worst rank is within 4/3 of the optimum.

Cost of a document of ``n`` tokens: ``n + n^2 / attention_length``: the linear layers (projections, MLP / MoE,
norms, the loss) cost the same per token, attention costs per token in proportion to the document length. A
token's attention costs as much as its linear layers when ``n`` is about ``12 x hidden_size`` for a model whose
every layer has attention (``2 n d`` for scores and values against ``24 d^2`` for the projections and MLP, per
token and layer); divide by the fraction of attention layers for hybrids (Qwen3-Next: 1/4).

Deterministic: the plan is a function of (lengths, seed, epoch, ranks, budget) only. Resumable: the state is
(epoch, step), restored with :meth:`BalancedBatchSampler.load_state_dict`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch


def document_cost(length: int, attention_length: float) -> float:
    """Relative compute of one document: linear in its tokens plus attention's quadratic term."""
    return length + length * length / attention_length


@dataclasses.dataclass
class BalancedBatchSampler:
    """Batch sampler of dataset indices: this rank's documents of each step, balanced by cost across ranks.

    Use it as a ``DataLoader``'s ``batch_sampler`` with a packing collator, on every data-parallel rank (every rank
    of a context-parallel group uses the group's data-parallel rank)::

        sampler = BalancedBatchSampler(lengths, num_replicas=dp_size, rank=dp_rank, tokens_per_rank=8192, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=compilepack.PackedCollator())
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader: ...
        state = sampler.state_dict()   # save with the checkpoint; sampler.load_state_dict(state) resumes there

    With HF Trainer, return such a DataLoader from ``get_train_dataloader`` (do not let accelerate re-shard it:
    it is already per rank).

    Args:
        lengths: token count of every dataset item, in dataset order.
        num_replicas: data-parallel ranks.
        rank: this rank, ``0 <= rank < num_replicas``.
        tokens_per_rank: the step's token budget per rank: a step takes documents in (shuffled) order while they
            fit in ``num_replicas * tokens_per_rank``; a rank may end slightly above or below it.
        seed: shuffling seed (the same on every rank).
        shuffle: shuffle the documents each epoch (``seed + epoch``); else dataset order.
        attention_length: see :func:`document_cost` (``12 x hidden_size`` for attention in every layer).
        drop_last: drop a final step that holds fewer than ``num_replicas`` documents (else it is kept and ranks
            without a document get none: only the last step).
    """

    lengths: Sequence[int]
    num_replicas: int
    rank: int
    tokens_per_rank: int
    seed: int = 0
    shuffle: bool = True
    attention_length: float = 12 * 4096
    drop_last: bool = False
    epoch: int = 0
    step: int = 0  # steps of ``epoch`` already yielded: where iteration resumes

    def __post_init__(self):
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank={self.rank} must be in [0, num_replicas={self.num_replicas}).")
        if self.tokens_per_rank < 1:
            raise ValueError(f"tokens_per_rank must be >= 1, got {self.tokens_per_rank}.")

    def plan(self, epoch: int | None = None) -> list[list[list[int]]]:
        """Every step of ``epoch``: for each rank, its dataset indices (the same on every rank)."""
        order = self._order(self.epoch if epoch is None else epoch)
        steps = [self._deal(step) for step in self._steps(order)]
        if self.drop_last and steps and any(not share for share in steps[-1]):
            steps.pop()
        return steps

    def __iter__(self) -> Iterator[list[int]]:
        for share in (steps := self.plan())[self.step :]:
            self.step += 1
            yield share[self.rank]
        if self.step >= len(steps):
            self.epoch, self.step = self.epoch + 1, 0

    def __len__(self) -> int:
        return len(self.plan()) - self.step

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"the saved sampler state has seed {state['seed']}, this sampler {self.seed}.")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    # ------------------------------------------------------------------------------------------ steps

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.lengths)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.lengths), generator=generator).tolist()

    def _steps(self, order: list[int]) -> list[list[int]]:
        """Consecutive documents while they fit in the global budget; at least one document per rank."""
        budget = self.num_replicas * self.tokens_per_rank
        steps, current, used = [], [], 0
        for index in order:
            length = self.lengths[index]
            if len(current) >= self.num_replicas and used + length > budget:
                steps.append(current)
                current, used = [], 0
            current.append(index)
            used += length
        if current:
            steps.append(current)
        return steps

    def _deal(self, step: list[int]) -> list[list[int]]:
        """Longest-processing-time first: costliest document to the least loaded rank (lowest rank on ties)."""
        return deal_by_cost([self.lengths[i] for i in step], self.num_replicas, self.attention_length, step)


def deal_by_cost(
    lengths: Sequence[int], ranks: int, attention_length: float, items: Sequence[int] | None = None
) -> list[list[int]]:
    """Split documents (``items``, default their positions) among ``ranks`` by LPT on :func:`document_cost`;
    each rank's items keep their arrival order."""
    items = list(range(len(lengths))) if items is None else list(items)
    costs = [document_cost(n, attention_length) for n in lengths]
    loads = [0.0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for position in sorted(range(len(items)), key=lambda p: (-costs[p], p)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        loads[rank] += costs[position]
        shares[rank].append(position)
    return [[items[p] for p in sorted(share)] for share in shares]


def deal_in_order(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """The unbalanced baseline: equal document counts per rank in arrival order (a ``DistributedSampler`` with a
    per-rank batch size), as positions."""
    per_rank, extra = divmod(len(lengths), ranks)
    shares, start = [], 0
    for rank in range(ranks):
        end = start + per_rank + (rank < extra)
        shares.append(list(range(start, end)))
        start = end
    return shares


def imbalance(lengths: Sequence[int], shares: list[list[int]], attention_length: float) -> float:
    """Max over ranks of a step's cost divided by the mean: 1.0 is perfect balance; the step lasts ``imbalance``
    times as long as a perfectly balanced one."""
    loads = [sum(document_cost(lengths[p], attention_length) for p in share) for share in shares]
    return max(loads) / (sum(loads) / len(loads))


def imbalance_report(
    lengths: Sequence[int], ranks: int, tokens_per_rank: int, attention_length: float = 12 * 4096, seed: int = 0
) -> dict:
    """Mean and worst imbalance over the steps of one epoch of ``lengths``: arrival-order dealing (before) and
    :class:`BalancedBatchSampler` (after), on the same steps. The epoch's last step (the leftover documents, a
    fraction of a step) is left out."""
    sampler = BalancedBatchSampler(lengths, ranks, 0, tokens_per_rank, seed=seed, attention_length=attention_length)
    before, after = [], []
    for step in sampler._steps(sampler._order(0))[:-1]:
        step_lengths = [lengths[i] for i in step]
        before.append(imbalance(step_lengths, deal_in_order(step_lengths, ranks), attention_length))
        after.append(imbalance(step_lengths, deal_by_cost(step_lengths, ranks, attention_length), attention_length))
    return {
        "steps": len(before), "ranks": ranks, "tokens_per_rank": tokens_per_rank, "attention_length": attention_length,
        "before_mean": sum(before) / len(before), "before_max": max(before),
        "after_mean": sum(after) / len(after), "after_max": max(after),
    }
