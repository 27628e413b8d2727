"""The benchmark's documents, the installed stdlib's ``.py`` sources as bytes (ids fit the bench vocabulary of
256; no downloads) at lognormal lengths (an SFT-like mix), and the batches every mode builds from them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import random
import sysconfig

import torch

from compilepack.batch import IGNORE_INDEX, PackedCollator
from compilepack.testing import packed_batch


@dataclasses.dataclass(frozen=True)
class LengthMix:
    """Lognormal document lengths clipped to [min_len, max_len] (median ``exp(mu)``)."""

    mu: float = 4.5  # median ~90 tokens, mean ~146: ~82% padding in arrival-order batches of ~8k tokens
    sigma: float = 1.0
    min_len: int = 8
    max_len: int = 1024

    def sample(self, count: int, seed: int) -> list[int]:
        generator = random.Random(seed)
        return [max(self.min_len, min(self.max_len, round(generator.lognormvariate(self.mu, self.sigma))))
                for _ in range(count)]


@functools.cache
def stdlib_corpus(min_bytes: int = 4_000_000) -> bytes:
    """Stdlib sources concatenated in sorted path order, until ``min_bytes`` (deterministic per Python)."""
    chunks, size = [], 0
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= min_bytes:
            break
    return b"\n".join(chunks)


def documents(lengths: list[int], seed: int) -> list[list[int]]:
    """One document per length: a slice of the corpus at a random offset, as byte token ids."""
    corpus, generator = stdlib_corpus(), random.Random(seed + 1)
    starts = [generator.randrange(0, len(corpus) - length) for length in lengths]
    return [list(corpus[start : start + length]) for start, length in zip(starts, lengths)]


def steps_by_token_budget(docs: list[list[int]], tokens_per_step: int) -> list[list[list[int]]]:
    """Consecutive documents (arrival order) grouped into steps of at most ``tokens_per_step`` real tokens."""
    steps, current, used = [], [], 0
    for doc in docs:
        if current and used + len(doc) > tokens_per_step:
            steps.append(current)
            current, used = [], 0
        current.append(doc)
        used += len(doc)
    return steps + [current] * bool(current)


def grouped_by_length(pool: list[list[list[int]]], tokens_per_step: int) -> list[list[list[int]]]:
    """HF Trainer's ``group_by_length``: a pool's documents sorted by length (longest first), cut into steps."""
    return steps_by_token_budget(sorted((doc for step in pool for doc in step), key=len, reverse=True),
                                 tokens_per_step)


def evenly_spaced(items: list, count: int) -> list:
    """``count`` items at evenly spaced positions (the middle of each of ``count`` equal slices)."""
    count = min(count, len(items))
    return [items[int((i + 0.5) * len(items) / count)] for i in range(count)]


def padded_batch(step: list[list[int]], multiple_of: int = 1, pad_token_id: int = 0) -> dict:
    """Right-padded ``[B, L]`` batch as ``DataCollatorForLanguageModeling`` makes it: attention_mask 0 and
    labels -100 on pads; ``L`` is the longest document, rounded up to ``multiple_of``."""
    length = math.ceil(max(len(doc) for doc in step) / multiple_of) * multiple_of
    input_ids = torch.full((len(step), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(step), length), dtype=torch.long)
    for row, doc in enumerate(step):
        input_ids[row, : len(doc)] = torch.tensor(doc)
        attention_mask[row, : len(doc)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def hf_packed_batch(step: list[list[int]]) -> dict:
    """The HF flattening collator's packed batch (one ``[1, T]`` row with every boundary kwarg), as
    ``compilepack.testing.packed_batch`` builds it."""
    return packed_batch(step).batch


def fixed_shape_collator(steps: list[list[list[int]]], tokens_per_step: int) -> PackedCollator:
    """A PackedCollator whose shape fits every step: one row of ``tokens_per_step`` tokens (or of the longest
    step, for small test budgets), room for the most documents any step has (rounded up to 64, plus padding's)."""
    most_docs = max(len(step) for step in steps) + 1
    row = max(tokens_per_step, *(sum(len(doc) for doc in step) for step in steps))
    return PackedCollator(row, fixed_shape=True, rows=1, max_docs=math.ceil(most_docs / 64) * 64)
