"""Model families: what a patch module in ``compilepack.patches`` declares.

A family file says, for one transformers modeling module, which class is the decoder (it receives the batch and
builds masks) and which layer classes call which kernel globals: the :class:`Family`, what runs. That is the whole
patch: compilepack rebinds those globals inside those forwards (``builder.py`` turns the declaration into forwards,
``rebind.py`` copies them). Beside it, the family's :class:`Fixtures` say everything else about it: its tiny test
configs, its benchmark config, the released checkpoint whose widths it mirrors, and its row in docs/models.md.
Adding a family is adding one file to ``patches/`` that calls :func:`~compilepack.patching.registry.register` (plus
its tests); no shared code changes, and nothing else names the family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..errors import UnsupportedModelError
from . import replacements as R

# The transformers releases compilepack is tested with (pyproject's dependency says the same; CI runs the family
# tests on the oldest and the newest). A family may narrow it (``Family.transformers``).
TESTED_TRANSFORMERS = ">=5.18,<5.26"

ConfigFactory = Callable[[], "transformers.PretrainedConfig"]


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """A tiny randomly initialised variant of a family for the tests: small enough for 2 CPU cores (hidden 64, 2-4
    layers, chunk size 64 so that 70-token documents cross chunk edges), with every layer kind of the family.

    Attributes:
        config: builds the config (a lambda, so that a transformers release without the family's classes fails
            only that family's tests).
        model_class: the transformers class that builds it (``AutoModelForCausalLM``, or e.g. a multimodal
            ``...ForConditionalGeneration``).
        moe: the variant has mixture-of-experts blocks (before transformers 5.23 their CPU ``grouped_mm`` fallback
            breaks the backward graph: stock code outside what compilepack patches).
    """

    config: ConfigFactory
    model_class: str = "AutoModelForCausalLM"
    moe: bool = False

    def build(self) -> torch.nn.Module:
        builder = getattr(transformers, self.model_class)
        config = self.config()
        return builder.from_config(config) if hasattr(builder, "from_config") else builder(config)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The smallest released checkpoint of a family, mirrored at reduced depth for the real-width benchmark.

    Attributes:
        name: its hub id (nothing is downloaded: the values are those of its public ``config.json``).
        config: its widths (hidden size, heads, head dims, mixer sizes, vocabulary) with one decoder layer of each
            kind the family mixes; a comment beside it says where a value is not the checkpoint's, and why.
    """

    name: str
    config: ConfigFactory


@dataclasses.dataclass(frozen=True)
class DocsRow:
    """The family's row of docs/models.md beyond what the declaration already says (layers, releases, kernels).

    Attributes:
        stock_packed: what stock transformers does with the family's packed batches, as measured by the generator.
        kernels_note: what the CUDA kernels column must add to what the replacements say (a kernel that serves
            only some widths, an op that pads), or "".
    """

    stock_packed: str
    kernels_note: str = ""


@dataclasses.dataclass(frozen=True)
class Fixtures:
    """What describes a family without running in a patched model: read by the tests, the benchmark and the docs
    generator, never by ``patch()``.

    Attributes:
        fixtures: its test models, benchmark config, checkpoint and docs row (:class:`Fixtures`).
    """

    tiny: Mapping[str, TinyModel] = dataclasses.field(default_factory=dict)
    bench: ConfigFactory | None = None
    checkpoint: Checkpoint | None = None
    docs: DocsRow | None = None


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: families are registry singletons
class Family:
    """One patchable model family: what runs (every attribute but the last), and what describes it (``fixtures``).

    Attributes:
        name: the registry key, the transformers ``model_type`` (``"my_model"``; the family file is
            ``patches/my_model.py``).
        modeling: the transformers modeling module (``"transformers.models.llama.modeling_llama"``).
        decoder: class whose forward receives the batch and builds masks (``"LlamaModel"``).
        layers: layer class name -> the :class:`~compilepack.patching.replacements.Replacement` s its forward
            needs (``{"LlamaAttention": (ATTENTION,)}``).
        model_types: every ``config.model_type`` this family serves (defaults to ``(name,)``).
        entries: classes above the decoder that receive the batch first (multimodal wrappers, CausalLM wrappers
            that drop ``position_ids``); their forward checks and prepares the packed kwargs, so e.g. position_ids
            restart per document before the wrapper would compute its own, and refuses a position_ids-only packed
            row before the wrapper drops its positions.
        boundary_calls: class name -> calls in its forward, as written (``"self.backbone"``, ``"self.mixer"``,
            ``"mamba_selective_scan"``), that must also receive the batch's boundary kwargs (taken from the
            forward's own ``**kwargs``): for stacks that drop ``**kwargs`` between the model and a mixer or on the
            way from a mixer to its kernel. Never name a call that already passes ``**kwargs``.
        transformers: the transformers releases this family is tested on, when narrower than compilepack's
            (``">=5.23"``: the model first shipped in 5.23); patch() refuses others.
        fixtures: its test models, benchmark config, checkpoint and docs row (:class:`Fixtures`).
    """

    name: str
    modeling: str
    decoder: str
    layers: Mapping[str, tuple[R.Replacement, ...]]
    model_types: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()
    boundary_calls: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    transformers: str = ""
    fixtures: Fixtures = dataclasses.field(default_factory=Fixtures)

    def tiny_model(self, variant: str | None = None) -> TinyModel:
        """The named tiny variant (default: the first declared)."""
        tiny = self.fixtures.tiny
        if not tiny:
            raise UnsupportedModelError(f"the {self.name} family declares no tiny test model (Fixtures.tiny).")
        return tiny[variant or next(iter(tiny))]

    def bench_config(self) -> transformers.PretrainedConfig:
        """The benchmark's model config (random weights are built from it: nothing is downloaded)."""
        if self.fixtures.bench is None:
            raise UnsupportedModelError(f"the {self.name} family declares no benchmark config (Fixtures.bench).")
        return self.fixtures.bench()

    @property
    def kernels(self) -> str:
        """What each CUDA kernel library runs for this family's layers, from its replacements (docs/models.md)."""
        texts = [r.kernels for needed in self.layers.values() for r in needed if r.kernels]
        docs = self.fixtures.docs
        note = [docs.kernels_note] if docs and docs.kernels_note else []
        return "; ".join([*dict.fromkeys(texts), *note])

    @property
    def ops(self) -> tuple[str, ...]:
        """The ops whose CUDA backend this family's layers run (``Backends`` keys), in declaration order."""
        return tuple(dict.fromkeys(op for needed in self.layers.values() for r in needed for op in r.ops))

    @property
    def served_model_types(self) -> tuple[str, ...]:
        return self.model_types or (self.name,)

    @property
    def supported_transformers(self) -> str:
        """The transformers releases this family is tested on, as a specifier (``">=5.18,<5.25"``)."""
        specifiers = list(SpecifierSet(TESTED_TRANSFORMERS) & SpecifierSet(self.transformers))
        # the tightest ">=" and "<" bound of the two sets: ">=5.23,<5.25", not ">=5.18,>=5.23,<5.25"
        lower = [s for s in specifiers if s.operator == ">="]
        upper = [s for s in specifiers if s.operator == "<"]
        others = [s for s in specifiers if s not in lower + upper]
        tightest = [max(lower, key=lambda s: Version(s.version))] * bool(lower)
        tightest += [min(upper, key=lambda s: Version(s.version))] * bool(upper)
        return ",".join(map(str, tightest + sorted(others, key=str)))  # lower bound first

    @property
    def available(self) -> bool:
        """Whether the installed transformers is one this family is tested on."""
        return SpecifierSet(self.supported_transformers).contains(Version(transformers.__version__), prereleases=True)

    @property
    def stock_packs_positions(self) -> bool:
        """Whether stock transformers keeps the documents of a position_ids-only packed row apart by itself (when it
        builds no cache): true of attention-only families, whose mask creator reads documents off position_ids;
        tests/patches/test_plain_batches.py measures it per family. Such rows then run stock instead of being
        refused."""
        return all(needed == (R.ATTENTION,) for needed in self.layers.values())

    @property
    def class_names(self) -> tuple[str, ...]:
        """Every class of the modeling module whose forward the patch replaces, each once."""
        names = [self.decoder, *self.layers, *self.boundary_calls, *self.entries]
        return tuple(dict.fromkeys(names))
