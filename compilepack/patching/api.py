"""``patch`` / ``unpatch`` / ``patched``: per-instance, idempotent, reversible.

The patch state is never stored beside the model: it is read from the forwards actually bound. A patched module
carries a :class:`PatchedForward` as its instance ``forward``; :func:`is_patched`, :func:`patch_state` and
:func:`unpatch` look for those in ``model.modules()``, so they see through wrappers that hold the model as a
submodule (PEFT's ``PeftModel``) and keep telling the truth after ``merge_and_unload()``, pickling or copying.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
import warnings
from collections.abc import Callable

import torch

from ..ops import backends as _backends
from ..distributed.group import ContextParallel, check_model
from ..errors import IncompatibleTransformersError, PatchConflictError
from .builder import build_forwards
from .registry import family_named, family_of


class PatchedForward:
    """The instance ``forward`` that :func:`patch` sets on a module: compilepack's forward bound to that module.

    It behaves like the bound method it replaces (same call, same ``inspect.signature`` as the stock forward) and
    also records how it was made (family, backends, context-parallel group). That is what lets it survive pickling:
    a bound method pickles by name, as ``getattr(module, "forward")``, and so comes back as the class's stock
    forward; this one pickles as "compilepack's forward of this family for this module" and is rebuilt from the
    registry when loaded
    (pickle, ``torch.save``/``torch.load``, ``copy.deepcopy``, multiprocessing: any pickler that honours
    ``__reduce__``).
    """

    __slots__ = ("function", "module", "family", "backends", "cp")

    def __init__(self, function, module: torch.nn.Module, family: str, backends: _backends.Backends, cp=None):
        self.function, self.module, self.family, self.backends, self.cp = function, module, family, backends, cp

    def __call__(self, *args, **kwargs):
        return self.function(self.module, *args, **kwargs)

    def __reduce__(self):
        return _rebound_forward, (self.module, self.family, self.backends, self.cp)

    @property
    def __func__(self):  # as on a bound method, for tools that read it
        return self.function

    @property
    def __self__(self) -> torch.nn.Module:
        return self.module

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.function, self.module))

    def __repr__(self) -> str:
        return f"<compilepack {self.family} forward of {type(self.module).__name__}>"


@dataclasses.dataclass(frozen=True)
class PatchState:
    """What :func:`patch` replaced on one model, as read from its modules' forwards."""

    family: str
    backends: _backends.Backends
    cp: ContextParallel | None  # the group patch(context_parallel=...) was given, as a ContextParallel
    modules: tuple[torch.nn.Module, ...]  # the modules that run compilepack's forward (possibly under a wrapper)


def patch(
    model: torch.nn.Module,
    *,
    backend: str | dict | _backends.Backends = "auto",
    context_parallel=None,
    lm_head: str | None = None,
) -> torch.nn.Module:
    """Make ``model`` run packed batches through compilepack's ops. Call before ``torch.compile``.

    Only this instance changes (its decoder's and mixing layers' ``forward`` are rebound); weights are not
    touched. Patching twice is a no-op; ``unpatch`` restores the model exactly.

    Args:
        model: a transformers model of a supported family (``compilepack.supported_model_types()``), or a
            wrapper of one (PEFT).
        backend: ``"auto"`` (on CUDA, the best installed kernel library per op), ``"reference"`` (pure torch
            everywhere), or per-op overrides such as ``{"attention": "torch_varlen"}``. On CPU the pure-torch
            references always run. Only the op kinds the model's family runs are resolved and checked: ``"auto"``
            skips a library compilepack refuses here with one ``KernelSkippedWarning``; one named in a dict is
            refused with ``KernelVersionError``.
        context_parallel: a process group (or 1-D DeviceMesh) to run Ulysses context parallelism over: each rank
            holds ``1 / W`` of every packed row (``compilepack.distributed.shard_batch``) and every sequence mixer
            runs head-parallel on the whole rows between two all-to-alls. Or a
            ``compilepack.distributed.ContextParallel``: ``ContextParallel.sequence_parallel(group)`` (every mixer
            runs on the rank's slice: W bounded by the tokens, not the heads) or ``ContextParallel.hybrid(mesh)``
            (Ulysses inside groups, sequence across them; a 2-D DeviceMesh named ``("sequence", "ulysses")`` passed
            here directly selects it too). See docs/context-parallel.md.
        lm_head: ``"chunked"``: a forward given ``labels`` computes the LM head and its loss a chunk of tokens at a
            time, never holding the ``[T, V]`` logits (``logits`` is then None; see docs/long-rows.md). None (the
            default) leaves the head as it is: the stock one, or the chunked one an earlier ``patch`` installed (a
            second ``patch``, by a trainer integration say, keeps it; :func:`unpatch` removes it). Either way, a TRL
            fused LM head on the model (``SFTTrainer``'s) is routed to compilepack's op so that it compiles to one
            graph, whether the trainer adds it before or after.

    Returns:
        ``model`` itself.

    Raises:
        UnsupportedModelError: no compilepack family for ``model.config.model_type``.
        IncompatibleTransformersError: the installed transformers lacks what the patch replaces.
        PatchConflictError: ``model`` is already compiled, or another tool replaced a forward.
        KernelVersionError: a kernel library named in ``backend`` is refused on this machine (all named at once).
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise PatchConflictError(
            "the model is already compiled: call compilepack.patch(model) first, then torch.compile(model)."
        )
    _check_extensions(lm_head=lm_head)
    family = family_of(model)
    chosen = _backends.resolve(backend, ops=family.ops)
    cp = None if context_parallel is None else _context_parallel(model, family, context_parallel)
    forwards = build_forwards(family, chosen, cp)
    targets = [(m, forward) for m in model.modules() if (forward := _forward_for(type(m), forwards)) is not None]
    state = patch_state(model)
    if state is not None:
        if (state.family, state.backends, state.cp, _ids(state.modules)) == (
                family.name, chosen, cp, _ids(m for m, _ in targets)):
            return _install_extensions(model, lm_head=lm_head)
        _unpatch_layers(model, state)  # another backend, or a partial patch: its layers from stock, the head kept
    _turn_off_hub_kernels(model)
    _refuse_foreign_forwards([m for m, _ in targets])
    _refuse_kernelized([m for m, _ in targets])
    for module, forward in targets:
        module.forward = PatchedForward(forward, module, family.name, chosen, cp)
    return _install_extensions(model, lm_head=lm_head)


def _context_parallel(model, family, group_or_mesh) -> ContextParallel:
    """The context-parallel group, after checking the model can be split over it."""
    cp = ContextParallel.of(group_or_mesh)
    check_model(model, family, cp)
    return cp


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: every compilepack forward found in ``model.modules()`` is removed, so the class's stock
    forward applies again (also through a PEFT wrapper, and after ``merge_and_unload()``).

    Raises:
        PatchConflictError: another tool wrapped a patched module's forward after :func:`patch` (accelerate hooks,
            a decorator): removing compilepack's forward from under that wrapper is impossible, and leaving the
            wrapper would keep calling compilepack. Nothing is changed; remove the other tool's wrapper first.
    """
    state = patch_state(model)
    if state is not None:
        _unpatch_layers(model, state)
    _remove_extensions(model)
    return model


def _unpatch_layers(model: torch.nn.Module, state: PatchState) -> None:
    wrapped = [m for m in state.modules if not isinstance(m.__dict__["forward"], PatchedForward)]
    if wrapped:
        raise PatchConflictError(
            f"cannot unpatch: the forward of {type(wrapped[0]).__name__} (and {len(wrapped) - 1} other module(s)) was "
            "wrapped by another tool after compilepack.patch (accelerate hooks, a decorator), and the wrapper would "
            "keep calling compilepack's forward. Remove that wrapper first (accelerate: "
            "accelerate.hooks.remove_hook_from_module(module, recurse=True)), then unpatch."
        )
    for module in state.modules:
        del module.__dict__["forward"]


def is_patched(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` (a PEFT wrapper's base model included) runs compilepack's forward."""
    return patch_state(model) is not None


def patch_state(model: torch.nn.Module) -> PatchState | None:
    """The family, backends, group and modules of ``model``'s patch, read from its forwards; None when none is
    patched."""
    found = [(m, forward) for m in model.modules() if (forward := _ours_within(m.__dict__.get("forward")))]
    if not found:
        return None
    first = found[0][1]
    return PatchState(first.family, first.backends, first.cp, tuple(m for m, _ in found))


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


def _rebound_forward(module: torch.nn.Module, family: str, backends: _backends.Backends, cp=None) -> PatchedForward:
    """Unpickling a :class:`PatchedForward`: the functions :func:`patch` made cannot be pickled by reference, so
    they are looked up again (the registry caches them). ``module`` may still be empty here (pickle fills its
    ``__dict__`` after rebuilding what it holds); only its class is read."""
    forward = _forward_for(type(module), build_forwards(family_named(family), backends, cp))
    if forward is None:
        raise IncompatibleTransformersError(
            f"cannot restore compilepack's forward of {type(module).__name__}: the {family} family no longer patches "
            "that class in this installation. Unpatch before pickling, or load with the same compilepack."
        )
    return PatchedForward(forward, module, family, backends, cp)


def _forward_for(cls: type, forwards: dict):
    """The patched forward for a module class, looked up along its MRO: wrappers such as FSDP2's
    ``fully_shard`` swap a module's class for a subclass (``FSDPLlamaModel``) of the stock one."""
    return next((forwards[base] for base in cls.__mro__ if base in forwards), None)


def _ids(modules) -> set[int]:
    return {id(m) for m in modules}


def _ours_within(forward) -> PatchedForward | None:
    """compilepack's forward, when ``forward`` is it or another tool's wrapper around it: accelerate keeps the
    wrapped forward in ``_old_forward`` on the module, ``functools.wraps`` in ``__wrapped__``, partials in
    ``func``/``args``."""
    seen, pending = set(), [forward]
    while pending:
        candidate = pending.pop()
        if candidate is None or id(candidate) in seen:
            continue
        seen.add(id(candidate))
        if isinstance(candidate, PatchedForward):
            return candidate
        pending += [getattr(candidate, "__wrapped__", None), getattr(candidate, "func", None)]
        pending += [a for a in getattr(candidate, "args", ()) if callable(a) and not isinstance(a, torch.nn.Module)]
        owner = getattr(candidate, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            pending.append(owner.__dict__.get("_old_forward"))
    return None


def _refuse_foreign_forwards(modules) -> None:
    for module in modules:
        forward = module.__dict__.get("forward")
        if forward is not None:
            raise PatchConflictError(
                f"{type(module).__name__} already has an instance-level forward ({forward!r}), set by another tool "
                "(accelerate hooks, a kernel patcher, ...). compilepack will not stack on it: patch the model "
                "before that tool, or undo the other patch first."
            )


def _turn_off_hub_kernels(model: torch.nn.Module) -> None:
    """transformers (5.25) loads every model with ``use_kernels=True`` where the `kernels` package is installed, and
    each ``model.train()`` / ``eval()`` then kernelizes the model again for the new mode, replacing the forwards of
    the layers with Hub kernels: compilepack's among them, silently (Qwen3.5's Gated DeltaNet lost them, found by
    the packed GRPO tests). It is turned off with transformers' own switch (its reset: the torch code), before the
    layers are patched; packed batches run compilepack's ops either way."""
    switched = [m for m in model.modules() if getattr(m, "use_kernels", False) is True]
    for module in switched:
        module.use_kernels = False
    if switched:
        warnings.warn(
            f"compilepack turned off transformers' Hub kernels on this {type(model).__name__} (use_kernels=True, set "
            "by from_pretrained where the `kernels` package is installed): model.train() / eval() would re-kernelize "
            "it and drop compilepack's patched forwards. Packed batches run compilepack's ops; plain batches run "
            "transformers' torch code. Load with use_kernels=False to skip this warning.", UserWarning, stacklevel=3,
        )


def _refuse_kernelized(modules) -> None:
    """A layer whose kernel functions the `kernels` package has kernelized (``kernels.kernelize``: an instance-level
    ``forward`` on one of ``module._kernel_funcs``, transformers 5.25) is refused: compilepack's forward leaves out
    the routing to those functions (rebind.is_kernel_func_router), so its plain batches would no longer run them."""
    for module in modules:
        kernelized = sorted(name for name, func in getattr(module, "_kernel_funcs", {}).items()
                            if "forward" in getattr(func, "__dict__", {}))
        if kernelized:
            raise PatchConflictError(
                f"{type(module).__name__}'s kernel functions {', '.join(kernelized)} are kernelized "
                "(kernels.kernelize). "
                "compilepack runs its own boundary-aware ops for packed batches and would no longer route plain "
                "batches to the kernelized functions: patch a model that is not kernelized."
            )


# ------------------------------------------------------------------------------------------------ model extensions
# What patch() installs on the whole model after its layers, and unpatch() removes: the chunked LM head
# (compilepack/patching/chunked_head.py) and the routing of TRL's fused head (compilepack/integrations/trl.py). They
# register themselves here as they are imported (compilepack/__init__.py imports both), so this layer never imports
# them.


@dataclasses.dataclass(frozen=True)
class ModelExtension:
    """One model-level extension. ``install(model, **options)`` runs on every :func:`patch` (idempotent), with
    the options patch() takes for extensions (``lm_head``); ``options`` names those this one reads, and ``check``
    refuses a bad value before anything is patched."""

    name: str
    install: Callable[..., None]
    remove: Callable[[torch.nn.Module], object]
    options: tuple[str, ...] = ()
    check: Callable[..., None] = lambda **options: None


_EXTENSIONS: dict[str, ModelExtension] = {}


def register_extension(extension: ModelExtension) -> None:
    _EXTENSIONS[extension.name] = extension


def _check_extensions(**options) -> None:
    claimed = {name for extension in _EXTENSIONS.values() for name in extension.options}
    unclaimed = sorted(name for name, value in options.items() if value is not None and name not in claimed)
    if unclaimed:  # never silently ignored: only if the module that reads the option was not imported
        raise ValueError(f"patch() options {unclaimed} have no extension to read them (import compilepack first).")
    for extension in _EXTENSIONS.values():
        extension.check(**options)


def _install_extensions(model: torch.nn.Module, **options) -> torch.nn.Module:
    for extension in _EXTENSIONS.values():
        extension.install(model, **options)
    return model


def _remove_extensions(model: torch.nn.Module) -> None:
    for extension in _EXTENSIONS.values():
        extension.remove(model)
