"""PEFT + gradient checkpointing, compiled: the input embeddings' ``requires_grad_()`` hook made traceable.

With frozen embeddings (LoRA), reentrant checkpointing would give the adapters inside a checkpointed layer no
gradient unless the layer's input requires grad, so transformers' ``enable_input_require_grads()`` (called by
``gradient_checkpointing_enable`` for PEFT models, by TRL's ``SFTTrainer`` for every PEFT model with
``gradient_checkpointing=True``, and by PEFT itself) registers a forward hook on the input embeddings doing
``output.requires_grad_(True)``. Dynamo cannot trace ``requires_grad_()`` on an intermediate: a compiled model
returning anything computed from it fails under ``fullgraph=True`` ("returning intermediate with requires_grad_()")
and breaks into 8 graphs with 17 breaks under Trainer's default compile (a tiny Qwen3.5, 4 steps).

Inside one compiled graph the hook has no reason to be: dynamo turns reentrant and non-reentrant
``torch.utils.checkpoint`` alike into one recompute region (``tag_activation_checkpoint``) and AOTAutograd
differentiates every op of the graph back to each trainable parameter, whether the embeddings' output requires
grad or not. So :func:`compilepack.patch` keeps the hook and lets it run only outside a compile
(:class:`InputsRequireGradOutsideCompile`): eager runs, reentrant ones included, see exactly the stock hook.

Per model instance, from what is installed: ``patch`` guards the hooks already on the model and sets, on each of
its transformers models, an instance ``enable_input_require_grads`` (:class:`GuardedEnableInputRequireGrads`) that
guards the hooks it adds, so a trainer enabling them later gets guarded ones. ``unpatch`` puts the stock hooks
and methods back.
"""

from __future__ import annotations

import torch

from ..patching.api import ModelExtension, register_extension

# The local functions that transformers (``PreTrainedModel.enable_input_require_grads``) and PEFT
# (``PeftModel._prepare_model_for_gradient_checkpointing``, ``mixed_model``) register as the hook.
_STOCK_HOOK_NAMES = ("<locals>.make_inputs_require_grads", "<locals>.make_inputs_require_grad")
_STOCK_HOOK_PACKAGES = ("transformers", "peft")
_METHOD = "enable_input_require_grads"


class InputsRequireGradOutsideCompile:
    """The forward hook that makes the input embeddings' output require grad (``original``: transformers' or
    PEFT's), skipped while dynamo traces: there ``requires_grad_()`` on an intermediate cannot be traced, and the
    compiled graph's own autograd reaches every adapter without it (see the module's docstring)."""

    __slots__ = ("original",)

    def __init__(self, original):
        self.original = original

    def __call__(self, module, args, output):
        if torch.compiler.is_compiling():
            return None
        return self.original(module, args, output)

    def __repr__(self) -> str:
        return f"<{self.original.__qualname__}, skipped under torch.compile by compilepack>"


class GuardedEnableInputRequireGrads:
    """The instance ``enable_input_require_grads`` of a patched transformers model: the class's own, then every
    hook it registered is guarded (:class:`InputsRequireGradOutsideCompile`)."""

    __slots__ = ("model",)

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self):
        result = type(self.model).enable_input_require_grads(self.model)
        guard_input_grad_hooks(self.model)
        return result

    def __repr__(self) -> str:
        return f"<enable_input_require_grads of {type(self.model).__name__}, guarded by compilepack>"


def is_stock_input_grad_hook(hook) -> bool:
    """Whether ``hook`` is transformers' or PEFT's ``make_inputs_require_grad(s)`` forward hook."""
    package = (getattr(hook, "__module__", None) or "").split(".")[0]
    return package in _STOCK_HOOK_PACKAGES and getattr(hook, "__qualname__", "").endswith(_STOCK_HOOK_NAMES)


def guard_input_grad_hooks(model: torch.nn.Module) -> int:
    """Guard every stock input-grad hook within ``model``; returns how many were guarded now."""
    guarded = 0
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if is_stock_input_grad_hook(hook):
                module._forward_hooks[key] = InputsRequireGradOutsideCompile(hook)  # same id: handles still remove it
                guarded += 1
    return guarded


def guarded_input_grad_hooks(model: torch.nn.Module) -> list[InputsRequireGradOutsideCompile]:
    """The guarded hooks installed within ``model`` now."""
    hooks = (hook for module in model.modules() for hook in module._forward_hooks.values())
    return [hook for hook in hooks if isinstance(hook, InputsRequireGradOutsideCompile)]


def unguard_input_grad_hooks(model: torch.nn.Module) -> int:
    """Put the stock hooks back; returns how many."""
    restored = 0
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if isinstance(hook, InputsRequireGradOutsideCompile):
                module._forward_hooks[key] = hook.original
                restored += 1
    return restored


def _transformers_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` with transformers' ``enable_input_require_grads`` (the causal LM and its decoder)."""
    return [m for m in model.modules() if callable(getattr(type(m), _METHOD, None)) and hasattr(m, "get_input_embeddings")]


def install(model: torch.nn.Module, **options) -> None:
    """:func:`compilepack.patch`'s step: guard the hooks already there and those enabled later. Idempotent; an
    instance ``enable_input_require_grads`` another tool set is left alone."""
    guard_input_grad_hooks(model)
    for module in _transformers_models(model):
        if _METHOD not in module.__dict__:
            setattr(module, _METHOD, GuardedEnableInputRequireGrads(module))


def remove(model: torch.nn.Module) -> None:
    """:func:`compilepack.unpatch`'s step: the stock hooks and the class's ``enable_input_require_grads`` again."""
    unguard_input_grad_hooks(model)
    for module in model.modules():
        if isinstance(module.__dict__.get(_METHOD), GuardedEnableInputRequireGrads):
            delattr(module, _METHOD)


register_extension(ModelExtension("input embeddings' requires_grad_ hook", install=install, remove=remove))
