"""PEFT + gradient checkpointing, compiled: the input embeddings' ``requires_grad_()`` hook made traceable.

With frozen embeddings (LoRA), reentrant checkpointing would give the adapters inside a checkpointed layer no
gradient unless the layer's input requires grad, so transformers' ``enable_input_require_grads()`` registers a
forward hook on the input embeddings doing ``output.requires_grad_(True)``. transformers 5.25 calls it from
``gradient_checkpointing_enable`` for every ``input_ids`` model (PEFT or not); TRL's trainers and PEFT call it for
PEFT models. Dynamo cannot trace ``requires_grad_()`` on an intermediate: a compiled model returning anything
computed from it fails under ``fullgraph=True`` ("returning intermediate with requires_grad_()") and breaks into 8
graphs with 17 breaks under Trainer's default compile (a tiny Qwen3.5, 4 steps).

Inside one compiled graph the hook has no reason to be: dynamo turns reentrant and non-reentrant
``torch.utils.checkpoint`` alike into one recompute region (``tag_activation_checkpoint``) and AOTAutograd
differentiates every op of the graph back to each trainable parameter, whether the embeddings' output requires
grad or not. So a patched model's hook does what the stock one does, outside a compile only
(:func:`requires_grad_outside_compile`): eager runs, reentrant ones included, see exactly the stock behaviour.

The mechanism, per model instance and through public methods only: ``patch`` sets an instance
``enable_input_require_grads`` on each transformers model within the patched model
(:class:`EnableInputRequireGradsOutsideCompile`), so every caller above (transformers, PEFT, TRL) registers
compilepack's hook, with torch's ``register_forward_hook``, on the embeddings transformers' own method would hook. Its
handles are kept where transformers keeps its own (``_require_grads_hooks``), so the class's
``disable_input_require_grads()`` removes them. Hooks enabled before ``patch`` are swapped the same way (the class's
``disable_input_require_grads()``, then compilepack's); ``unpatch`` swaps back. Why no smaller seam exists:
docs/integrations.md, "Seams".
"""

from __future__ import annotations

import torch

from ..patching.api import ModelExtension, register_extension

_METHOD = "enable_input_require_grads"
_HANDLES = "_require_grads_hooks"  # where transformers' enable / disable_input_require_grads keep the handles


def requires_grad_outside_compile(module, args, output) -> None:
    """transformers' ``make_inputs_require_grads`` forward hook, skipped while dynamo traces (see the module's
    docstring for why the compiled graph needs no such hook)."""
    if not torch.compiler.is_compiling():
        output.requires_grad_(True)


class EnableInputRequireGradsOutsideCompile:
    """The instance ``enable_input_require_grads`` of a patched transformers model: the class's method, with
    :func:`requires_grad_outside_compile` as the hook. Enabling twice keeps one hook per embedding."""

    __slots__ = ("model",)

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self) -> None:
        embeddings = input_embeddings(self.model)
        if not embeddings:  # the class's method warns that it found none
            return type(self.model).enable_input_require_grads(self.model)
        self.model.disable_input_require_grads()
        handles = [module.register_forward_hook(requires_grad_outside_compile) for module in embeddings]
        setattr(self.model, _HANDLES, handles)
        self.model._require_grads_hook = handles[0]  # transformers' name for the first, kept for its BC readers

    def __repr__(self) -> str:
        return f"<enable_input_require_grads of {type(self.model).__name__}, skipped under torch.compile>"


def input_embeddings(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embeddings ``PreTrainedModel.enable_input_require_grads`` hooks: each transformers model's within
    ``model``, once each."""
    from transformers import PreTrainedModel

    found = {}
    for module in model.modules():
        if not (isinstance(module, PreTrainedModel) and hasattr(module, "get_input_embeddings")):
            continue
        try:
            embeddings = module.get_input_embeddings()
        except NotImplementedError:
            continue
        if embeddings is not None and hasattr(embeddings, "register_forward_hook"):
            found.setdefault(id(embeddings), embeddings)
    return list(found.values())


def input_grads_enabled(module: torch.nn.Module) -> bool:
    """Whether ``enable_input_require_grads()`` was called on ``module`` (and not disabled since)."""
    return bool(getattr(module, _HANDLES, None))


def _transformers_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` with transformers' ``enable_input_require_grads`` (the causal LM and its decoder)."""
    return [m for m in model.modules()
            if callable(getattr(type(m), _METHOD, None)) and hasattr(m, "get_input_embeddings")]


def install(model: torch.nn.Module, **options) -> None:
    """:func:`compilepack.patch`'s step: compilepack's ``enable_input_require_grads`` on each transformers model, and
    its hook in place of one enabled already. Idempotent; an instance ``enable_input_require_grads`` another tool set
    is left alone."""
    for module in _transformers_models(model):
        if _METHOD in module.__dict__:
            continue
        setattr(module, _METHOD, EnableInputRequireGradsOutsideCompile(module))
        if input_grads_enabled(module):
            module.enable_input_require_grads()  # the stock hooks out, compilepack's in


def remove(model: torch.nn.Module) -> None:
    """:func:`compilepack.unpatch`'s step: the class's ``enable_input_require_grads`` again, and its stock hook in
    place of compilepack's where one is enabled."""
    for module in model.modules():
        if isinstance(module.__dict__.get(_METHOD), EnableInputRequireGradsOutsideCompile):
            delattr(module, _METHOD)
            if input_grads_enabled(module):
                module.disable_input_require_grads()
                module.enable_input_require_grads()


register_extension(ModelExtension("input embeddings' requires_grad_ hook", install=install, remove=remove))
