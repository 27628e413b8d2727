"""Turning a family declaration into patched forwards: for each class the family names, a copy of the installed
transformers forward whose kernel globals are rebound to compilepack's replacements (``rebind.py``), the decoder's
and entries' wrapped to prepare the batch (``decoder.py``). Every mismatch between the declaration and the installed
release (a class, global, parameter or call that moved) is refused here, at ``patch()`` time, naming the family.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import types
from collections.abc import Callable

import transformers

from ..batch.keys import BOUNDARY_KEYS
from ..errors import IncompatibleTransformersError
from ..ops.backends import Backends
from . import replacements as R
from .decoder import packed_decoder_forward
from .family import Family
from .rebind import global_loads, innermost, install, named_calls, with_globals


def build_forwards(family: Family, backends: Backends, cp=None) -> dict[type, Callable]:
    """class -> the patched forward for it, checking the installed transformers first. ``cp``: the model's
    ``ContextParallel`` (None: no context parallelism)."""
    if not family.available:
        raise _incompatible(family, "this family is not supported")
    stock = _import_modeling(family)
    classes = {name: _class(family, stock, name) for name in family.class_names}
    return _patched_forwards(family, backends, cp, tuple((name, cls, cls.forward) for name, cls in classes.items()))


@functools.cache
def _patched_forwards(family: Family, backends: Backends, cp, classes: tuple) -> dict[type, Callable]:
    """Cached per family, backends, group and the classes' current forwards (a class-level patch made later by
    another tool gives a fresh copy of the new forward)."""
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
    built = {name: _build(family, stock, r, backends, cp) for name, r in everything.items()}
    renames = install(stock, _key(backends, cp), built)
    helpers = set().union(*vias.values())
    renames |= install(stock, _key(backends, cp), {name: _rebound_helper(family, stock, name, renames)
                                                   for name in helpers})
    forwards = {}
    for cls, needed in plan.items():
        own = {r.global_name: renames[r.global_name] for r in needed}
        own |= {name: renames[name] for name in vias.get(cls, ())}
        try:
            forwards[cls] = with_globals(cls.forward, own, threaded[cls])
        except IncompatibleTransformersError as error:  # say which family's declaration or release is at fault
            raise IncompatibleTransformersError(f"cannot patch {family.name}: {error}") from error
    forwards[decoder_cls] = packed_decoder_forward(
        forwards[decoder_cls], decoder_cls.forward, _parameter_names(decoder_cls.forward),
        stock_packs_positions=family.stock_packs_positions, cp_group=cp,
    )
    for class_name in family.entries:
        cls = by_name[class_name]
        own = forwards.get(cls, cls.forward)  # an entry may also thread boundaries into its calls
        forwards[cls] = packed_decoder_forward(own, cls.forward, _parameter_names(cls.forward), cp_group=cp)
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


def _key(backends: Backends, cp) -> str:
    """A short identifier of a backend choice and group, for the private global names
    (``__compilepack_<key>_<name>``)."""
    chosen = backends.describe() + ("" if cp is None else f", cp_group={cp.describe()}")
    return "b" + hashlib.sha1(chosen.encode()).hexdigest()[:8]


def _build(family: Family, stock: types.ModuleType, replacement: R.Replacement, backends: Backends, cp):
    original = getattr(stock, replacement.global_name, None)
    if original is None:
        raise _incompatible(family, f"{stock.__name__}.{replacement.global_name} does not exist")
    if replacement.expected_params:
        params = set(inspect.signature(function_behind(original) or original).parameters)
        absent = [p for p in replacement.expected_params if not params & set((p,) if isinstance(p, str) else p)]
        if absent:
            raise _incompatible(family, f"{replacement.global_name}() lost parameters {absent}")
    return replacement.make(original, backends, cp)


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
