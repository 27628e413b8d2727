"""The family registry: each module in ``compilepack.patches`` registers its :class:`~.family.Family` on import;
``patch()`` finds a model's family by ``config.model_type``. The family files are discovered, never listed: a new
family is a new file."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from ..errors import UnsupportedModelError
from .family import Family

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
