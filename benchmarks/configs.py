"""The models the benchmark trains, as each family declares them in its file in ``patches/``:

- ``bench`` widths (the default): ``Family.bench``, hidden 256 and one layer of each mixer kind, so that every
  mode's cold compile fits the default run's budget on 2 CPU cores;
- ``real`` widths: ``Family.checkpoint``, the widths of the family's smallest released checkpoint at reduced depth
  (one decoder layer of each kind, the real vocabulary).
"""

from __future__ import annotations

import torch
import transformers

from compilepack.patching import Family, families, family_named


def has_config(family: Family, widths: str) -> bool:
    return widths == "bench" or family.fixtures.checkpoint is not None


def bench_config(family_name: str, widths: str = "bench") -> transformers.PretrainedConfig:
    """The family's benchmark config: ``widths="bench"`` the small default, ``"real"`` its smallest release's
    widths."""
    family = family_named(family_name)
    if widths == "bench":
        return family.bench_config()
    if family.fixtures.checkpoint is None:
        have = ", ".join(f.name for f in families() if f.fixtures.checkpoint is not None)
        raise KeyError(f"no real-width config for family {family_name!r} (families with one: {have}); declare "
                       f"its Family.checkpoint in patches/{family_name}.py.")
    return family.fixtures.checkpoint.config()


def build_bench_model(family_name: str) -> torch.nn.Module:
    """The benchmark's model of ``family_name``, randomly initialised."""
    return transformers.AutoModelForCausalLM.from_config(bench_config(family_name))
