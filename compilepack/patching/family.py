"""Model families: what a patch module in ``compilepack.patches`` declares, and the registry that finds them.

A family file says, for one transformers modeling module, which class is the decoder (it receives the batch
and builds masks) and which layer classes call which kernel globals. That is the whole patch: compilepack
rebinds those globals inside those forwards (see ``rebind.py``). Adding a family is adding one file to
``patches/`` that calls :func:`register`; no shared code changes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
import types
from collections.abc import Callable, Mapping

import torch
import transformers

from ..backends import Backends
from ..errors import IncompatibleTransformersError, UnsupportedModelError
from . import replacements as R
from .batch import bridging_forward, packed_decoder_forward
from .rebind import innermost, rebound_module, with_globals

TESTED_TRANSFORMERS = ">=5.24,<5.25"


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: families are registry singletons
class Family:
    """One patchable model family.

    Attributes:
        name: the registry key, the transformers ``model_type`` (``"llama"``).
        modeling: the transformers modeling module (``"transformers.models.llama.modeling_llama"``).
        decoder: class whose forward receives the batch and builds masks (``"LlamaModel"``).
        layers: layer class name -> the :class:`~compilepack.patching.replacements.Replacement` s its forward
            needs (``{"LlamaAttention": (ATTENTION,)}``).
        tiny_configs: named factories of tiny configs with every layer type, for tests, ``explain`` and the
            benchmark; the first is the default.
        model_types: every ``config.model_type`` this family serves (defaults to ``(name,)``).
        entries: classes above the decoder that receive the batch first (multimodal wrappers); their forward
            only prepares the packed kwargs, so e.g. position_ids restart per document before the wrapper
            would compute its own.
        kwargs_bridges: wrapper class name -> attribute of the decoder it calls without ``**kwargs``
            (``{"Mamba2ForCausalLM": "backbone"}``): the boundary kwargs are carried across that call.
        boundary_calls: class name -> calls in its forward, as written (``"self.mixer"``,
            ``"mamba_selective_scan"``), that must also receive the batch's boundary kwargs (taken from the
            forward's own ``**kwargs``): for stacks that drop ``**kwargs`` between layers, or on the way from a
            mixer to its kernel (the Mamba1 models). The classes need no other entry. Never name a call that
            already passes ``**kwargs``.
        tiny_builders: variant -> transformers class name used to build it (default ``AutoModelForCausalLM``).
        bench_config: the config ``python -m compilepack bench`` trains (hidden 256 and one layer of each mixer
            kind fit the default run's 10-minute budget); defaults to the first tiny config.
        kernels: what each CUDA backend runs for this family, for the docs table.
        stock_packed: what stock transformers does with a packed batch of this family (measured), for the docs.
    """

    name: str
    modeling: str
    decoder: str
    layers: Mapping[str, tuple[R.Replacement, ...]]
    tiny_configs: Mapping[str, Callable[[], transformers.PretrainedConfig]]
    model_types: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()
    kwargs_bridges: Mapping[str, str] = dataclasses.field(default_factory=dict)
    boundary_calls: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    tiny_builders: Mapping[str, str] = dataclasses.field(default_factory=dict)
    bench_config: Callable[[], transformers.PretrainedConfig] | None = None
    kernels: str = ""
    stock_packed: str = ""

    @property
    def served_model_types(self) -> tuple[str, ...]:
        return self.model_types or (self.name,)

    def tiny_config(self, variant: str | None = None) -> transformers.PretrainedConfig:
        return self.tiny_configs[variant or next(iter(self.tiny_configs))]()

    def build_tiny(self, variant: str | None = None) -> torch.nn.Module:
        """A randomly initialised tiny model of this family (no download)."""
        variant = variant or next(iter(self.tiny_configs))
        builder = getattr(transformers, self.tiny_builders.get(variant, "AutoModelForCausalLM"))
        config = self.tiny_configs[variant]()
        return builder.from_config(config) if hasattr(builder, "from_config") else builder(config)

    def forwards(self, backends: Backends) -> dict[type, Callable]:
        """class -> the patched forward for it, checking the installed transformers first."""
        return _patched_forwards(self, backends)


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
def _patched_forwards(family: Family, backends: Backends) -> dict[type, Callable]:
    stock = _import_modeling(family)
    decoder_cls = _class(stock, family.decoder)
    # Models without attention (Mamba, Mamba2) build no causal mask: their decoder only prepares the batch.
    plan = {decoder_cls: tuple(r for r in R.MASK_CREATORS if r.global_name in _global_names(decoder_cls))}
    for class_name, needed in family.layers.items():
        cls = _class(stock, class_name)
        missing = [r.global_name for r in needed if r.global_name not in _global_names(cls)]
        if missing:
            raise _incompatible(family, f"{class_name}.forward no longer calls {', '.join(missing)}")
        plan[cls] = tuple(needed)
    for class_name in family.boundary_calls:
        plan.setdefault(_class(stock, class_name), ())
    everything = {r.global_name: r for needed in plan.values() for r in needed}
    rebound = rebound_module(
        stock, {name: _build(family, stock, r, backends) for name, r in everything.items()}, key=(backends,)
    )
    forwards = {cls: with_globals(cls.forward, rebound, tuple(family.boundary_calls.get(cls.__name__, ())))
                for cls in plan}
    for forward in forwards.values():
        innermost(forward).__compilepack__ = True
    forwards[decoder_cls] = packed_decoder_forward(forwards[decoder_cls], _parameter_names(decoder_cls.forward))
    for class_name in family.entries:
        cls = _class(stock, class_name)
        forwards[cls] = packed_decoder_forward(cls.forward, _parameter_names(cls.forward))
    for class_name, child in family.kwargs_bridges.items():
        cls = _class(stock, class_name)
        forwards[cls] = bridging_forward(cls.forward, _parameter_names(cls.forward), child)
    return forwards


def _build(family: Family, stock: types.ModuleType, replacement: R.Replacement, backends: Backends):
    original = getattr(stock, replacement.global_name, None)
    if original is None:
        raise _incompatible(family, f"{stock.__name__}.{replacement.global_name} does not exist")
    if replacement.expected_params:
        params = set(inspect.signature(original).parameters)
        absent = [p for p in replacement.expected_params if p not in params]
        if absent:
            raise _incompatible(family, f"{replacement.global_name}() lost parameters {absent}")
    return replacement.make(original, backends)


def _import_modeling(family: Family) -> types.ModuleType:
    try:
        return importlib.import_module(family.modeling)
    except ImportError as error:
        raise _incompatible(family, f"cannot import {family.modeling} ({error})") from error


def _class(module: types.ModuleType, name: str) -> type:
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise IncompatibleTransformersError(
            f"{module.__name__}.{name} does not exist in transformers {transformers.__version__}; compilepack's "
            f"patches are tested with transformers{TESTED_TRANSFORMERS}."
        )
    return cls


def _global_names(cls: type) -> set[str]:
    return set(innermost(cls.forward).__code__.co_names)


def _parameter_names(forward: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(innermost(forward)).parameters)[1:]  # without self


def _incompatible(family: Family, what: str) -> IncompatibleTransformersError:
    return IncompatibleTransformersError(
        f"cannot patch {family.name}: {what} in transformers {transformers.__version__}. compilepack's patches are "
        f"tested with transformers{TESTED_TRANSFORMERS}; install a version in that range."
    )
