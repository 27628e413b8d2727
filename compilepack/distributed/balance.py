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
(epoch, steps taken), restored with :meth:`BalancedBatchSampler.load_state_dict`; the steps taken are counted where
the training loop receives its batches, not where a loader's workers draw them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Iterable, Iterator, Sequence

import torch


def document_cost(length: int, attention_length: float) -> float:
    """Relative compute of one document: linear in its tokens plus attention's quadratic term."""
    return length + length * length / attention_length


@dataclasses.dataclass
class BalancedBatchSampler:
    """Batch sampler of dataset indices: this rank's documents of each step, balanced by cost across ranks.

    Use it on every data-parallel rank (every rank of a context-parallel group uses the group's data-parallel rank),
    through :meth:`loader`, which counts the batches the training loop takes::

        sampler = BalancedBatchSampler(lengths, num_replicas=dp_size, rank=dp_rank, tokens_per_rank=8192, seed=0)
        loader = sampler.loader(dataset, collate_fn=compilepack.PackedCollator(), num_workers=2)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader: ...
        state = sampler.state_dict()   # save with the checkpoint; sampler.load_state_dict(state) resumes there

    A ``DataLoader`` with workers draws batches of indices ahead of the loop (``prefetch_factor x num_workers``), so
    what the sampler has yielded is not what was trained on: the state counts the batches :meth:`loader` (or
    :meth:`track` around another loader) handed to the loop. After an untracked iteration (a plain ``DataLoader``
    given ``batch_sampler=sampler``), :meth:`state_dict` refuses mid-epoch unless told the step
    (``state_dict(step=steps_taken)``).

    Every rank gets a document in every step: a final step with fewer (non-empty) documents than ranks joins the
    step before it (``drop_last=True`` drops it instead); an epoch with fewer documents than ranks has no step, on
    every rank alike, with a warning. A document longer than ``tokens_per_rank`` is warned about once (its rank's
    row is that long).

    With HF Trainer, return such a DataLoader from ``get_train_dataloader`` (do not let accelerate re-shard it:
    it is already per rank).

    Args:
        lengths: token count of every dataset item, in dataset order (ints >= 0).
        num_replicas: data-parallel ranks.
        rank: this rank, ``0 <= rank < num_replicas``.
        tokens_per_rank: the step's token budget per rank: a step takes documents in (shuffled) order while they
            fit in ``num_replicas * tokens_per_rank``; a rank may end slightly above or below it.
        seed: shuffling seed (the same on every rank).
        shuffle: shuffle the documents each epoch (``seed + epoch``); else dataset order.
        attention_length: see :func:`document_cost` (``12 x hidden_size`` for attention in every layer).
        drop_last: drop a final step that holds fewer documents than ranks, instead of joining it to the one before.
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
    step: int = 0  # steps of ``epoch`` the training loop has taken: where iteration resumes
    _tracked: bool = dataclasses.field(default=False, init=False, repr=False)  # counting consumption (loader/track)
    _untracked_ahead: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank={self.rank} must be in [0, num_replicas={self.num_replicas}).")
        if self.tokens_per_rank < 1:
            raise ValueError(f"tokens_per_rank must be >= 1, got {self.tokens_per_rank}.")
        bad = next((i for i, n in enumerate(self.lengths) if isinstance(n, bool) or int(n) != n or n < 0), None)
        if bad is not None:
            raise ValueError(f"lengths[{bad}] = {self.lengths[bad]!r}: every length must be an int >= 0 (the token "
                             "count of that dataset item).")
        over = [n for n in self.lengths if n > self.tokens_per_rank]
        if over:
            warnings.warn(
                f"BalancedBatchSampler: {len(over)} document(s) are longer than tokens_per_rank={self.tokens_per_rank} "
                f"(the longest {max(over)} tokens): each goes whole to one rank, whose row is then that long. Raise "
                "tokens_per_rank, or split or drop such documents before sampling.", stacklevel=2)

    def plan(self, epoch: int | None = None) -> list[list[list[int]]]:
        """Every step of ``epoch``: for each rank, its dataset indices (the same on every rank)."""
        order = self._order(self.epoch if epoch is None else epoch)
        return [self._deal(step) for step in self._steps(order)]

    def __iter__(self) -> Iterator[list[int]]:
        steps = self.plan()
        self._untracked_ahead = not self._tracked and self.step < len(steps)
        for share in steps[self.step:]:
            if not self._tracked:  # no consumption count: yielded is all the sampler knows
                self.step += 1
            yield share[self.rank]
        if not self._tracked:
            self.epoch, self.step = self.epoch + 1, 0

    def __len__(self) -> int:
        return len(self.plan()) - self.step

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    # ------------------------------------------------------------------------------------------ resume

    def loader(self, dataset, **dataloader_kwargs) -> torch.utils.data.DataLoader:
        """A ``DataLoader`` over ``dataset`` with this sampler as its ``batch_sampler`` (any other DataLoader
        option: ``collate_fn``, ``num_workers``, ``prefetch_factor``...), whose iteration counts the batches it hands
        to the training loop: :meth:`state_dict` is then exact whatever its workers draw ahead."""
        return _CountingLoader(dataset, batch_sampler=self, **dataloader_kwargs)

    def track(self, batches: Iterable) -> Iterator:
        """Iterate ``batches`` (a loader over this sampler), counting each batch handed on as a step taken; the
        end of the iteration ends the epoch. What :meth:`loader` does, for loaders built elsewhere."""
        self._tracked = True
        try:
            for batch in batches:
                self.step += 1
                yield batch
            self.epoch, self.step = self.epoch + 1, 0
        finally:
            self._tracked = False

    def state_dict(self, step: int | None = None) -> dict:
        """Where iteration resumes: the epoch, the steps taken (counted by :meth:`loader` / :meth:`track`, or
        ``step`` when given), and the settings that decide the plan (checked by :meth:`load_state_dict`)."""
        if step is None and self._untracked_ahead and not self._tracked and self.step > 0:
            raise ValueError(
                "BalancedBatchSampler.state_dict(): this epoch was iterated by a loader the sampler cannot count (a "
                "plain DataLoader: its workers draw batches ahead of the training loop, so the steps the sampler "
                "yielded are not the steps taken). Iterate sampler.loader(dataset, ...) or sampler.track(loader), or "
                "pass the steps taken: sampler.state_dict(step=steps_taken)."
            )
        return {"epoch": self.epoch, "step": self.step if step is None else int(step), "seed": self.seed,
                "settings": self._settings()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"the saved sampler state has seed {state['seed']}, this sampler {self.seed}.")
        saved, now = state.get("settings"), self._settings()
        if saved is not None and saved != now:
            differ = "; ".join(f"{key}: saved {saved.get(key)!r}, now {now.get(key)!r}"
                               for key in sorted({**saved, **now}) if saved.get(key) != now.get(key))
            raise ValueError(
                f"the saved sampler state was made with other settings ({differ}): its plan differs, so resuming "
                "would skip or repeat documents. Build the sampler with the saved settings (and the same dataset)."
            )
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._untracked_ahead = False

    def _settings(self) -> dict:
        """What decides the plan besides the seed (the rank does not: every rank shares one plan)."""
        digest = hashlib.sha1(",".join(map(str, self.lengths)).encode()).hexdigest()[:16]
        return {"num_replicas": self.num_replicas, "tokens_per_rank": self.tokens_per_rank, "shuffle": self.shuffle,
                "attention_length": self.attention_length, "drop_last": self.drop_last,
                "documents": len(self.lengths), "lengths_sha1": digest}

    # ------------------------------------------------------------------------------------------ steps

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.lengths)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.lengths), generator=generator).tolist()

    def _steps(self, order: list[int]) -> list[list[int]]:
        """Consecutive documents while they fit in the global budget, each step with at least one non-empty
        document per rank; a short final step joins the step before (or is dropped with ``drop_last``)."""
        budget = self.num_replicas * self.tokens_per_rank
        steps, current, used, filled = [], [], 0, 0
        for index in order:
            length = self.lengths[index]
            if filled >= self.num_replicas and used + length > budget:
                steps.append(current)
                current, used, filled = [], 0, 0
            current.append(index)
            used, filled = used + length, filled + (length > 0)
        if current and filled >= self.num_replicas:
            steps.append(current)
        elif current and steps and not self.drop_last:
            steps[-1] = steps[-1] + current  # every rank gets a document: the leftovers join the last full step
        elif current and not steps:
            warnings.warn(
                f"BalancedBatchSampler: the epoch holds {filled} non-empty document(s) for {self.num_replicas} "
                "ranks: no step can give every rank a document, so every rank skips it (no step this epoch).",
                stacklevel=3)
        return steps

    def _deal(self, step: list[int]) -> list[list[int]]:
        """Longest-processing-time first: costliest document to the least loaded rank (lowest rank on ties)."""
        return deal_by_cost([self.lengths[i] for i in step], self.num_replicas, self.attention_length, step)


class _CountingLoader(torch.utils.data.DataLoader):
    """A DataLoader whose iteration goes through its :class:`BalancedBatchSampler`'s
    :meth:`~BalancedBatchSampler.track`."""

    def __iter__(self):
        # the base iterator is made inside track(), once counting is on: its workers draw indices as soon as it
        # exists, and those draws must not count as steps taken
        return self.batch_sampler.track(_Later(super().__iter__))


class _Later:
    """An iterable that makes its iterator only when iterated."""

    def __init__(self, make_iterator):
        self.make_iterator = make_iterator

    def __iter__(self):
        return self.make_iterator()


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
