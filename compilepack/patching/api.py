"""``patch`` / ``unpatch`` / ``patched``: per-instance, idempotent, reversible."""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch

from .. import backends as _backends
from ..errors import PatchConflictError
from .family import family_of

_STATE = "_compilepack_patch"


@dataclasses.dataclass(frozen=True)
class PatchState:
    """What ``patch`` replaced on one model: enough for ``unpatch`` to restore it exactly."""

    family: str
    backends: _backends.Backends
    modules: tuple[torch.nn.Module, ...]  # the modules whose instance ``forward`` compilepack set


def patch(model: torch.nn.Module, *, backend: str | dict | _backends.Backends = "auto") -> torch.nn.Module:
    """Make ``model`` run packed batches through compilepack's ops. Call before ``torch.compile``.

    Only this instance changes (its decoder's and mixing layers' ``forward`` are rebound); weights are not
    touched. Patching twice is a no-op; ``unpatch`` restores the model exactly.

    Args:
        model: a transformers model of a supported family (``compilepack.supported_model_types()``), or a
            wrapper of one (PEFT).
        backend: ``"auto"`` (on CUDA, the best installed kernel library per op), ``"reference"`` (pure torch
            everywhere), or per-op overrides such as ``{"attention": "torch_varlen"}``. On CPU the pure-torch
            references always run.

    Returns:
        ``model`` itself.

    Raises:
        UnsupportedModelError: no compilepack family for ``model.config.model_type``.
        IncompatibleTransformersError: the installed transformers lacks what the patch replaces.
        PatchConflictError: ``model`` is already compiled, or another tool replaced a forward.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise PatchConflictError(
            "the model is already compiled: call compilepack.patch(model) first, then torch.compile(model)."
        )
    chosen = _backends.resolve(backend)
    state = model.__dict__.get(_STATE)
    if state is not None:
        if state.backends == chosen:
            return model
        unpatch(model)
    family = family_of(model)
    forwards = family.forwards(chosen)
    targets = [(m, forward) for m in model.modules() if (forward := _forward_for(type(m), forwards)) is not None]
    _refuse_foreign_forwards([m for m, _ in targets])
    for module, forward in targets:
        module.forward = types.MethodType(forward, module)
    model.__dict__[_STATE] = PatchState(family.name, chosen, tuple(m for m, _ in targets))
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: every rebound ``forward`` is removed, so the class's stock forward applies again.

    Raises:
        PatchConflictError: another tool wrapped a patched module's forward after :func:`patch` (accelerate hooks,
            a decorator): removing compilepack's forward from under that wrapper is impossible, and leaving the
            wrapper would keep calling compilepack. Nothing is changed; remove the other tool's wrapper first.
    """
    state = model.__dict__.get(_STATE)
    if state is None:
        return model
    wrapped = [m for m in state.modules if _wraps_ours(m.__dict__.get("forward"))]
    if wrapped:
        raise PatchConflictError(
            f"cannot unpatch: the forward of {type(wrapped[0]).__name__} (and {len(wrapped) - 1} other module(s)) was "
            "wrapped by another tool after compilepack.patch (accelerate hooks, a decorator), and the wrapper would "
            "keep calling compilepack's forward. Remove that wrapper first (accelerate: "
            "accelerate.hooks.remove_hook_from_module(module, recurse=True)), then unpatch."
        )
    del model.__dict__[_STATE]
    for module in state.modules:
        if _is_ours(module.__dict__.get("forward")):
            del module.__dict__["forward"]
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return _STATE in model.__dict__


def patch_state(model: torch.nn.Module) -> PatchState | None:
    return model.__dict__.get(_STATE)


@contextlib.contextmanager
def patched(model: torch.nn.Module, *, backend: str | dict | _backends.Backends = "auto"):
    """``with compilepack.patched(model):`` patch for the block, then restore (unless it was patched before)."""
    was_patched = is_patched(model)
    patch(model, backend=backend)
    try:
        yield model
    finally:
        if not was_patched:
            unpatch(model)


def _forward_for(cls: type, forwards: dict):
    """The patched forward for a module class, looked up along its MRO: wrappers such as FSDP2's
    ``fully_shard`` swap a module's class for a subclass (``FSDPLlamaModel``) of the stock one."""
    return next((forwards[base] for base in cls.__mro__ if base in forwards), None)


def _is_ours(forward) -> bool:
    """Whether an instance forward is the bound method compilepack set (its function, or one it decorates)."""
    function = getattr(forward, "__func__", None)
    while function is not None:
        if getattr(function, "__compilepack__", False):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def _wraps_ours(forward) -> bool:
    """Whether an instance forward is another tool's wrapper around compilepack's: accelerate keeps the wrapped
    forward in ``_old_forward`` on the module, ``functools.wraps`` in ``__wrapped__``, partials in ``func``/``args``."""
    if forward is None or _is_ours(forward):
        return False
    seen, pending = set(), [forward]
    while pending:
        candidate = pending.pop()
        if candidate is None or id(candidate) in seen:
            continue
        seen.add(id(candidate))
        if _is_ours(candidate):
            return True
        pending += [getattr(candidate, "__wrapped__", None), getattr(candidate, "func", None)]
        pending += [a for a in getattr(candidate, "args", ()) if callable(a) and not isinstance(a, torch.nn.Module)]
        owner = getattr(candidate, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            pending.append(owner.__dict__.get("_old_forward"))
    return False


def _refuse_foreign_forwards(modules) -> None:
    for module in modules:
        forward = module.__dict__.get("forward")
        if forward is not None and not _is_ours(forward):
            raise PatchConflictError(
                f"{type(module).__name__} already has an instance-level forward ({forward!r}), set by another tool "
                "(accelerate hooks, a kernel patcher, ...). compilepack will not stack on it: patch the model "
                "before that tool, or undo the other patch first."
            )
