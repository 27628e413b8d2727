"""Model families: what a patch module in ``compilepack.patches`` declares, and the registry that finds them.

A family file says, for one transformers modeling module, which class is the decoder (it receives the batch and
builds masks) and which layer classes call which kernel globals. That is the whole patch: compilepack rebinds
those globals inside those forwards (see ``rebind.py``). The same declaration also says everything else about the
family: its tiny test configs, its benchmark config, the released checkpoint whose widths it mirrors, and its row
in docs/models.md. Adding a family is adding one file to ``patches/`` that calls :func:`register` (plus its
tests); no shared code changes, and nothing else names the family.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import pkgutil
import types
from collections.abc import Callable, Mapping

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..ops.backends import Backends
from ..batch.keys import BOUNDARY_KEYS
from ..errors import IncompatibleTransformersError, UnsupportedModelError
from . import replacements as R
from .decoder import packed_decoder_forward
from .rebind import global_loads, innermost, install, named_calls, with_globals

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


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: families are registry singletons
class Family:
    """One patchable model family: what runs (the first attributes), and what describes it (the last four: test
    configs, benchmark config, checkpoint and docs row, read by the tests, the benchmark and the docs generator).

    Attributes:
        name: the registry key, the transformers ``model_type`` (``"my_model"``; the family file is ``patches/my_model.py``).
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
        tiny: variant name -> :class:`TinyModel`, the first the default: the test models.
        bench: the benchmark's model config (hidden 256, one layer of each mixer kind); ``python -m compilepack
            explain`` and ``check`` build it for a family name.
        checkpoint: the released checkpoint whose widths the real-width benchmark mirrors (None: not benchmarked
            at real widths).
        docs: its docs/models.md row.
    """

    name: str
    modeling: str
    decoder: str
    layers: Mapping[str, tuple[R.Replacement, ...]]
    model_types: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()
    boundary_calls: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    transformers: str = ""
    tiny: Mapping[str, TinyModel] = dataclasses.field(default_factory=dict)
    bench: ConfigFactory | None = None
    checkpoint: Checkpoint | None = None
    docs: DocsRow | None = None

    def tiny_model(self, variant: str | None = None) -> TinyModel:
        """The named tiny variant (default: the first declared)."""
        if not self.tiny:
            raise UnsupportedModelError(f"the {self.name} family declares no tiny test model (Family.tiny).")
        return self.tiny[variant or next(iter(self.tiny))]

    def bench_config(self) -> transformers.PretrainedConfig:
        """The benchmark's model config (random weights are built from it: nothing is downloaded)."""
        if self.bench is None:
            raise UnsupportedModelError(f"the {self.name} family declares no benchmark config (Family.bench).")
        return self.bench()

    @property
    def kernels(self) -> str:
        """What each CUDA kernel library runs for this family's layers, from its replacements (docs/models.md)."""
        texts = [r.kernels for needed in self.layers.values() for r in needed if r.kernels]
        note = [self.docs.kernels_note] if self.docs and self.docs.kernels_note else []
        return "; ".join([*dict.fromkeys(texts), *note])

    @property
    def op_kinds(self) -> tuple[str, ...]:
        """The op kinds whose CUDA backend this family's layers run (``Backends`` fields), in declaration order."""
        return tuple(dict.fromkeys(kind for needed in self.layers.values() for r in needed for kind in r.kinds))

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

    def forwards(self, backends: Backends) -> dict[type, Callable]:
        """class -> the patched forward for it, checking the installed transformers first."""
        if not self.available:
            raise _incompatible(self, "this family is not supported")
        stock = _import_modeling(self)
        classes = {name: _class(self, stock, name) for name in self._class_names()}
        return _patched_forwards(self, backends, tuple((name, cls, cls.forward) for name, cls in classes.items()))

    def _class_names(self) -> tuple[str, ...]:
        names = [self.decoder, *self.layers, *self.boundary_calls, *self.entries]
        return tuple(dict.fromkeys(names))


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family to the registry (called by each module in ``compilepack.patches``)."""
    for model_type in family.served_model_types:
        existing = _REGISTRY.get(model_type)
        if existing is not None and existing is not family:
            raise ValueError(f"model_type {model_type!r} is registered twice ({existing.name}, {family.name}).")
        _REGISTRY[model_type] = family
    return family


@functools.cache
def _discover() -> None:
    import compilepack.patches as patches

    for info in pkgutil.iter_modules(patches.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{patches.__name__}.{info.name}")


def families() -> list[Family]:
    """Every registered family, each once, in name order."""
    _discover()
    return sorted({id(f): f for f in _REGISTRY.values()}.values(), key=lambda f: f.name)


def family_named(name: str) -> Family:
    _discover()
    if name not in _REGISTRY:
        raise UnsupportedModelError(f"no compilepack family {name!r}; supported: {', '.join(supported_model_types())}.")
    return _REGISTRY[name]


def supported_model_types() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def family_of(model) -> Family:
    """The family that patches ``model``, from ``model.config.model_type``."""
    _discover()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _REGISTRY:
        raise UnsupportedModelError(
            f"compilepack has no patch for model_type {model_type!r} ({type(model).__name__}). Supported "
            f"model types: {', '.join(supported_model_types())}. To add one, see docs/adding-a-family.md."
        )
    return _REGISTRY[model_type]


# ------------------------------------------------------------------------------------------------ building forwards


@functools.cache
def _patched_forwards(family: Family, backends: Backends, classes: tuple) -> dict[type, Callable]:
    """Cached per family, backends and the classes' current forwards (a class-level patch made later by another
    tool gives a fresh copy of the new forward)."""
    stock = _import_modeling(family)
    by_name = {name: cls for name, cls, _ in classes}
    decoder_cls = by_name[family.decoder]
    # Models without attention (Mamba, Mamba2) build no causal mask: their decoder only prepares the batch.
    plan = {decoder_cls: tuple(r for r in R.MASK_CREATORS if r.global_name in _global_loads(decoder_cls))}
    vias: dict[type, set[str]] = {}  # class -> the stock helper functions its forward reaches a kernel through
    dropped: dict[type, set[str]] = {}  # class -> the optional kernels (fused paths) its forward no longer calls
    for class_name, needed in family.layers.items():
        cls = by_name[class_name]
        loaded = _global_loads(cls)
        present = tuple(r for r in needed if not (r.optional and r.global_name not in loaded))
        dropped[cls] = {r.global_name for r in needed if r not in present}
        for replacement in present:
            route = _route(family, class_name, replacement, loaded)
            if route != replacement.global_name:
                vias.setdefault(cls, set()).add(route)
        plan[cls] = plan.get(cls, ()) + present
    for class_name in family.boundary_calls:
        plan.setdefault(by_name[class_name], ())
    threaded = {cls: _threaded_calls(family, stock, cls, vias.get(cls, set()), dropped.get(cls, set())) for cls in plan}
    everything = {r.global_name: r for needed in plan.values() for r in needed}
    renames = install(stock, _key(backends), {name: _build(family, stock, r, backends) for name, r in everything.items()})
    helpers = set().union(*vias.values())
    renames |= install(stock, _key(backends), {name: _rebound_helper(family, stock, name, renames) for name in helpers})
    forwards = {}
    for cls, needed in plan.items():
        own = {r.global_name: renames[r.global_name] for r in needed} | {name: renames[name] for name in vias.get(cls, ())}
        try:
            forwards[cls] = with_globals(cls.forward, own, threaded[cls])
        except IncompatibleTransformersError as error:  # say which family's declaration or release is at fault
            raise IncompatibleTransformersError(f"cannot patch {family.name}: {error}") from error
    forwards[decoder_cls] = packed_decoder_forward(
        forwards[decoder_cls], decoder_cls.forward, _parameter_names(decoder_cls.forward),
        stock_packs_positions=family.stock_packs_positions, cp_group=backends.cp_group,
    )
    for class_name in family.entries:
        cls = by_name[class_name]
        own = forwards.get(cls, cls.forward)  # an entry may also thread boundaries into its calls
        forwards[cls] = packed_decoder_forward(own, cls.forward, _parameter_names(cls.forward),
                                               cp_group=backends.cp_group)
    return forwards


def _route(family: Family, class_name: str, replacement: R.Replacement, loaded: set[str]) -> str:
    """The global through which ``class_name``'s forward reaches ``replacement``: its own name (up to transformers
    5.24), or the stock helper function that calls it (5.25's ``causal_conv1d_forward``, ``mamba2_scan_forward``)."""
    if replacement.global_name in loaded:
        return replacement.global_name
    for helper in replacement.via:
        if helper in loaded:
            return helper
    through = f" (nor {', '.join(replacement.via)}, which calls it)" if replacement.via else ""
    raise _incompatible(family, f"{class_name}.forward no longer loads the global {replacement.global_name}{through}")


def _threaded_calls(family: Family, stock: types.ModuleType, cls: type, helpers: set[str],
                    dropped: set[str]) -> tuple[str, ...]:
    """The calls named in ``family.boundary_calls`` for ``cls`` that its forward makes without ``**kwargs`` in the
    installed release (those must be threaded; a call that forwards ``**kwargs`` receives the boundaries already).
    A named call the forward no longer makes is refused, unless it is a kernel the forward now reaches through a
    stock helper function (rebound and threaded itself: ``_rebound_helper``) or an optional fused kernel the release
    dropped."""
    declared = tuple(family.boundary_calls.get(cls.__name__, ()))
    found = named_calls(cls.forward, declared)
    reached = set().union(*(_function_loads(getattr(stock, helper)) for helper in helpers))
    moved = set(declared) & reached
    missing = sorted(set(declared) - found.keys() - moved - dropped)
    if missing:
        raise _incompatible(family, f"{cls.__name__}.forward no longer calls {', '.join(missing)}")
    return tuple(call for call, forwards in found.items() if not forwards)


def _rebound_helper(family: Family, stock: types.ModuleType, name: str, renames: dict[str, str]) -> Callable:
    """What a patched forward calls in place of the stock helper function ``name`` (5.25's ``causal_conv1d_forward``,
    ``mamba2_scan_forward``, ``mamba_scan_forward``): for a packed batch a copy of the helper that reads compilepack's
    replacements of the kernel globals it calls (the calls among them that drop ``**kwargs`` threaded, so they
    receive the boundaries); for any other batch the stock helper itself, as it is bound now (a function, or the
    module the `kernels` package makes of it, kernelized or not)."""
    original = getattr(stock, name)
    function = _helper_function(family, stock, name, original)
    own = {global_name: private for global_name, private in renames.items() if global_name in _function_loads(function)}
    dropping = tuple(call for call, forwards in named_calls(function, tuple(own)).items() if not forwards)
    try:
        packed = with_globals(function, own, dropping)
    except IncompatibleTransformersError as error:
        raise IncompatibleTransformersError(f"cannot patch {family.name}: {error}") from error

    def helper(*args, **kwargs):
        # a static fact (whether the batch carries boundaries), never tensor data: no guard changes between batches
        if any(kwargs.get(key) is not None for key in BOUNDARY_KEYS):
            return packed(*args, **kwargs)
        return getattr(stock, name)(*args, **kwargs)  # read at the call, as stock's own forward reads it

    helper.__name__ = helper.__qualname__ = name
    return helper


def _helper_function(family: Family, stock: types.ModuleType, name: str, helper: object) -> types.FunctionType:
    function = function_behind(helper)
    if function is None:
        raise _incompatible(family, (
            f"{stock.__name__}.{name} is a {type(helper).__name__} whose function compilepack cannot find (the "
            "`kernels` package's function modules changed)"
        ))
    return function


def function_behind(kernel: object) -> Callable | None:
    """The Python function behind a transformers kernel global: itself, or, where the `kernels` package is installed
    and ``use_kernel_forward_from_hub`` has turned the function into a module, the function that module calls (the
    ``func`` its class's ``forward`` closes over); None if neither."""
    if isinstance(innermost(kernel), types.FunctionType):
        return kernel
    forward = getattr(type(kernel), "forward", None)
    wrapped = inspect.getclosurevars(forward).nonlocals.get("func") if inspect.isfunction(forward) else None
    return wrapped if isinstance(wrapped, types.FunctionType) else None


def _key(backends: Backends) -> str:
    """A short identifier of a backend choice, for the private global names (``__compilepack_<key>_<name>``)."""
    return "b" + hashlib.sha1(backends.describe().encode()).hexdigest()[:8]


def _build(family: Family, stock: types.ModuleType, replacement: R.Replacement, backends: Backends):
    original = getattr(stock, replacement.global_name, None)
    if original is None:
        raise _incompatible(family, f"{stock.__name__}.{replacement.global_name} does not exist")
    if replacement.expected_params:
        params = set(inspect.signature(function_behind(original) or original).parameters)
        absent = [p for p in replacement.expected_params if not params & set((p,) if isinstance(p, str) else p)]
        if absent:
            raise _incompatible(family, f"{replacement.global_name}() lost parameters {absent}")
    return replacement.make(original, backends)


def _import_modeling(family: Family) -> types.ModuleType:
    try:
        return importlib.import_module(family.modeling)
    except ImportError as error:
        raise _incompatible(family, f"cannot import {family.modeling} ({error})") from error


def _class(family: Family, module: types.ModuleType, name: str) -> type:
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise _incompatible(family, f"{module.__name__}.{name} does not exist")
    return cls


def _global_loads(cls: type) -> set[str]:
    return _function_loads(cls.forward)


def _function_loads(function: Callable) -> set[str]:
    return global_loads(innermost(function_behind(function) or function).__code__)


def _parameter_names(forward: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(innermost(forward)).parameters)[1:]  # without self


def _incompatible(family: Family, what: str) -> IncompatibleTransformersError:
    return IncompatibleTransformersError(
        f"cannot patch {family.name}: {what} in transformers {transformers.__version__}. compilepack supports "
        f"{family.name} on transformers{family.supported_transformers} (docs/models.md lists every family's "
        "releases); install a release in that range."
    )
