"""The benchmark's modes: how each one batches the same documents (the same real-token budget per step), and
whether it patches and compiles. The stock padded modes are what users run with HF Trainer; the packed modes get
the HF flattening collator's batch or compilepack's fixed-shape ``PackedCollator``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from compilepack.batch import PackedCollator
from compilepack.testing import packed_batch, padded_batch

from . import data

EAGER, DYNAMIC, STATIC = None, "dynamic", "static"
PADDED_EAGER_WARMUP_TOKENS = 1024

# Each mode's name, spelled once: the JSON, the markdown and ``--modes`` use these strings, the code the constants.
STOCK_PADDED_EAGER = "stock_padded_eager"
STOCK_PADDED_COMPILED = "stock_padded_compiled"
STOCK_GROUPED_EAGER = "stock_grouped_eager"
STOCK_GROUPED_COMPILED = "stock_grouped_compiled"
STOCK_PACKED = "stock_packed"
PATCHED_PACKED_EAGER = "patched_packed_eager"
PATCHED_PACKED_COMPILED = "patched_packed_compiled"
PATCHED_FIXED_COMPILED = "patched_fixed_compiled"


class Batch(NamedTuple):
    tensors: dict
    docs: list[list[int]]

    @property
    def real_tokens(self) -> int:
        return sum(len(doc) for doc in self.docs)

    @property
    def shaped_tokens(self) -> int:  # padding included
        return self.tensors["input_ids"].numel()


@dataclasses.dataclass(frozen=True)
class Workload:
    """The documents of a run: ``warmup_steps`` then ``steps`` timed rounds; round ``r`` of an arrival-order mode
    is the same step of at most ``tokens_per_step`` real tokens for every such mode, of the grouped mode
    ``grouped_per_round`` steps of the length-sorted pool of ``group_pool`` arrival steps."""

    tokens_per_step: int = 8192
    steps: int = 3
    warmup_steps: int = 1
    group_pool: int = 50  # HF's LengthGroupedSampler sorts mega-batches of 50 batches
    grouped_per_round: int = 3  # grouped steps per round: long, middle and short documents all represented
    seed: int = 0
    mix: data.LengthMix = dataclasses.field(default_factory=data.LengthMix)

    def arrival_steps(self) -> tuple[list, list]:
        """(warm-up steps, timed steps), each a list of documents in arrival order; timed step ``r`` is round r."""
        steps = self._steps(self.warmup_steps + self.steps)
        return steps[: self.warmup_steps], steps[self.warmup_steps :]

    def grouped_rounds(self) -> list[list]:
        """Each round's steps of the length-sorted pool: ``steps * grouped_per_round`` evenly spaced steps, cut
        into bands (long, middle, short) and dealt out like a snake draft, so every round has a long, a middle and
        a short step and no round gets the longest of every band."""
        count = self.steps * self.grouped_per_round
        positions = data.evenly_spaced(self._grouped_pool(), count)
        return [[positions[band * self.steps + (r if band % 2 == 0 else self.steps - 1 - r)]
                 for band in range(self.grouped_per_round)] for r in range(self.steps)]

    def grouped_warmup(self) -> list:
        """The first ``warmup_steps`` of the length-sorted pool: the largest batches the grouped rounds build."""
        return self._grouped_pool()[: self.warmup_steps]

    def _grouped_pool(self) -> list:
        """The pool's steps re-cut by length, longest documents first (HF Trainer's ``group_by_length``)."""
        count = self.steps * self.grouped_per_round
        pool = self._steps(self.warmup_steps + max(count, self.group_pool))[self.warmup_steps :]
        return data.grouped_by_length(pool, self.tokens_per_step)

    def _steps(self, count: int) -> list:
        lengths, seed = [], self.seed
        while sum(lengths) < (count + 1) * self.tokens_per_step:
            lengths += self.mix.sample(256, seed)
            seed += 1
        return data.steps_by_token_budget(data.documents(lengths, self.seed), self.tokens_per_step)[:count]


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    layout: str  # how a step's documents become a batch: see ``_LAYOUT_TEXTS``
    patched: bool
    compile: str | None  # None: eager; "dynamic": torch.compile(dynamic=True); "static": plain torch.compile

    @property
    def description(self) -> str:
        """The mode in words: the model, the batches, the compile as the worker applies it."""
        model = "compilepack.patch(model)" if self.patched else "stock model"
        options = ["fullgraph=True"] * self.patched + ["dynamic=True"] * (self.compile == DYNAMIC)
        compiled = "eager" if self.compile is EAGER else f"torch.compile({', '.join(options)})"
        return f"{model}, {_LAYOUT_TEXTS[self.layout]}, {compiled}"

    def batches(self, workload: Workload) -> tuple[list[Batch], list[list[Batch]]]:
        """(warm-up batches, the timed batches of each round). Modes warm up on a full step of their own layout, so a
        compile sees a real shape; except stock padded eager, whose full step is the run's costliest (3-11 s on 2
        cores): it warms up on 1k tokens, and the median leaves out its slower round 0."""
        warmup, timed = workload.arrival_steps()
        if self.layout in GROUPED_LAYOUTS:
            warmup, rounds = workload.grouped_warmup(), workload.grouped_rounds()
        else:  # a patched mode trains on its round's step as often as the grouped mode has steps in a round, so the
            # driver interleaves them step by step (one step against three spreads the paired ratios twice as much)
            rounds = [[step] * (workload.grouped_per_round if self.patched else 1) for step in timed]
        if self.layout == "padded" and self.compile is EAGER:
            warmup = [data.steps_by_token_budget(step, PADDED_EAGER_WARMUP_TOKENS)[0] for step in warmup]
        collate = self._collate(workload)
        return ([Batch(collate(step), step) for step in warmup],
                [[Batch(collate(step), step) for step in steps] for steps in rounds])

    def _collate(self, workload: Workload):
        """How a step's documents become this mode's batch (see ``_LAYOUT_TEXTS``)."""
        if self.layout in ("padded", "grouped"):
            return padded_batch
        if self.layout in ("padded64", "grouped64"):
            return lambda step: padded_batch(step, multiple_of=64)
        if self.layout == "hf_packed":  # the HF flattening collator's one row with every boundary kwarg
            return lambda step: packed_batch(step).batch
        # "fixed": one row that fits every step (the budget, or the longest step for small test budgets), room for
        # the most documents any step has plus padding's, rounded up to 64
        steps = [step for part in workload.arrival_steps() for step in part]
        row = max(workload.tokens_per_step, *(sum(len(doc) for doc in step) for step in steps))
        most_docs = math.ceil((max(len(step) for step in steps) + 1) / 64) * 64
        collate = PackedCollator(row, fixed_shape=True, rows=1, max_docs=most_docs)
        return lambda step: collate([{"input_ids": doc} for doc in step])


GROUPED_LAYOUTS = ("grouped", "grouped64")

_LAYOUT_TEXTS = {
    "padded": "batches right-padded to their longest sample in arrival order",
    "padded64": "arrival-order batches padded to a multiple of 64",
    "grouped": "padded batches cut from the length-sorted pool of 50 steps (HF Trainer group_by_length), "
               "a long, a middle and a short one per round",
    "grouped64": "the grouped mode's batches, padded to a multiple of 64",
    "hf_packed": "the HF flattening collator's packed batch",
    "fixed": "PackedCollator(fixed_shape=True) batches",
}

MODES = (
    Mode(STOCK_PADDED_EAGER, "padded", patched=False, compile=EAGER),
    Mode(STOCK_PADDED_COMPILED, "padded64", patched=False, compile=DYNAMIC),
    Mode(STOCK_GROUPED_EAGER, "grouped", patched=False, compile=EAGER),
    Mode(STOCK_GROUPED_COMPILED, "grouped64", patched=False, compile=DYNAMIC),
    Mode(STOCK_PACKED, "hf_packed", patched=False, compile=EAGER),
    Mode(PATCHED_PACKED_EAGER, "hf_packed", patched=True, compile=EAGER),
    Mode(PATCHED_PACKED_COMPILED, "hf_packed", patched=True, compile=DYNAMIC),
    Mode(PATCHED_FIXED_COMPILED, "fixed", patched=True, compile=STATIC),
)

MODE_NAMES = tuple(mode.name for mode in MODES)
PADDED_MODES = (STOCK_PADDED_EAGER, STOCK_PADDED_COMPILED, STOCK_GROUPED_EAGER, STOCK_GROUPED_COMPILED)

# Stock torch.compile(dynamic=True) of these families fails in inductor on the bench models (torch 2.13.0,
# transformers 5.24.0) after 40-85 s: the default run reports the error without running; --full and --modes run it.
STOCK_INDUCTOR_FAILS = {
    "qwen3_next": "InductorError: TypeError: cannot determine truth value of Relational: 256*(((s27 + (Mod(64 - "
                  "(Mod(s27, 64)), 64)))//64))*... < 8",
    "qwen3_5": "InductorError: TypeError: cannot determine truth value of Relational: 1 < s27",
    "bamba": "InductorError: TypeError: cannot determine truth value of Relational: 1 < s27",
}

# What the default run leaves out (``--full`` runs every mode), and why: sized for ~10 minutes on 2 idle cores, its
# five cold compiles and timed steps keep both cores busy ~7 minutes (docs/benchmarks.md, "What the default costs").
LEFT_OUT_BY_DEFAULT = {
    STOCK_PADDED_COMPILED: "a cold stock compile per family (25 s for Llama; on the hybrids inductor fails after "
                           "40-85 s with InductorError), so the default has no stock compile time to compare and "
                           "the 5x bar compares against stock padded eager only",
    PATCHED_FIXED_COMPILED: "an extra cold compile per family (16-28 s) for the fixed-shape variant of a mode "
                            "the default already runs",
}
DEFAULT_MODES = tuple(name for name in MODE_NAMES if name not in LEFT_OUT_BY_DEFAULT)


def mode_named(name: str) -> Mode:
    if name not in MODE_NAMES:
        raise ValueError(f"no benchmark mode {name!r}; modes: {', '.join(MODE_NAMES)}.")
    return MODES[MODE_NAMES.index(name)]
