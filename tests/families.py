"""The tests' view of the families' tiny models: each family declares its tiny configs in its own file in
``patches/`` (``Fixtures.tiny``: randomly initialised models small enough for 2 CPU cores, with every layer type of
the family, the first variant its default). Config classes are looked up when a config is built, so a transformers
release without a family's classes fails only that family's tests.
"""

from __future__ import annotations

import functools

import torch
import transformers
from packaging.version import Version

from compilepack.patching import Family, families

# Before transformers 5.23 the tiny variants with mixture-of-experts blocks (``TinyModel.moe``) run, on CPU,
# transformers' own grouped_mm fallback, whose backward reads a tensor value (`.item()`) and breaks the graph:
# stock code outside the mixers compilepack patches (on CUDA, torch's native grouped_mm runs instead).
GROUPED_MM_FALLBACK_BREAKS = Version(transformers.__version__) < Version("5.23")


def available_families() -> list[Family]:
    """The registered families the installed transformers has (and compilepack supports there): the ones the
    registry-wide tests run. On an older release a newer family (LFM3 before 5.23) is left out."""
    return [family for family in families() if family.available]


def variants(family: Family) -> list[str]:
    return list(family.fixtures.tiny)


def mixers_of(family: Family) -> frozenset[str]:
    """The transformers globals a family's layers have replaced: which sequence mixers it runs."""
    return frozenset(r.global_name for needed in family.layers.values() for r in needed)


@functools.cache
def representatives() -> frozenset[tuple[str, str]]:
    """(family, variant) pairs the README's test command compiles: for every combination of mixers a family runs,
    the first family (by name) with its default variant, and the headline families benchmarked at real widths
    (Llama, Qwen3-Next, Qwen3.5, Bamba). The other families run the same ops wired otherwise: their compile tests
    are the exhaustive matrix, marked ``slow`` (CI's stage after the README's command)."""
    chosen = {}
    for family in sorted(available_families(), key=lambda f: f.name):
        chosen.setdefault(mixers_of(family), family)
    headline = [family for family in available_families() if family.fixtures.checkpoint is not None]
    return frozenset((family.name, variants(family)[0]) for family in [*chosen.values(), *headline])


def is_moe(family: Family, variant: str | None = None) -> bool:
    return family.tiny_model(variant).moe


def tiny_config(family: Family, variant: str | None = None) -> transformers.PretrainedConfig:
    return family.tiny_model(variant).config()


def build_tiny(family: Family, variant: str | None = None) -> torch.nn.Module:
    """A randomly initialised tiny model of ``family`` (its default variant unless named)."""
    return family.tiny_model(variant).build()
