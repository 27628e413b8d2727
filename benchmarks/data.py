"""The benchmark's documents, the installed stdlib's ``.py`` sources as bytes (ids fit the bench vocabulary of
256; no downloads) at lognormal lengths (an SFT-like mix), cut into steps (``modes`` makes their batches).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import random
import sysconfig


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

