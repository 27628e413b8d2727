"""TRL's LM heads compiled to one graph: compilepack's own forward in the place TRL's trainers install theirs.

TRL 1.16's trainers (``SFTTrainer`` always) add a fused LM head with ``trl.trainer.utils.add_fused_lm_head``: an
instance ``forward`` on the causal LM which, called with ``fused_lm_head=True``, runs the backbone and scores the
tokens in tiles (``ChunkedLogProbFunction``), without the ``[T, V]`` logits. That kernel breaks dynamo's graph twice
(``torch.mm(..., out=tile)`` on a non-contiguous tile, Python loops over tiles): 3 graphs per step.

compilepack recognises that head on the model instance and puts its own forward there (:class:`RoutedFusedHead`):
same call, same outputs (TRL's ``FusedCausalLMOutput``: ``loss``, ``log_probs``, ``entropy``, ``is_top1``, ...; the
same label shifting, ``shift_labels``, ``num_items_in_batch`` and MoE aux loss), scored by
``compilepack::lm_head_logprobs`` (one opaque node: no break, no recompile as ``T`` changes). TRL's options
(``temperature``, ``outputs``, the fp32 cast, the logit transform) are read from the head it replaces. Every
position is scored and labels ``-100`` masked after, so shapes never depend on how many tokens are labelled. Calls
without ``fused_lm_head`` go to TRL's head (that is, to the forward TRL wrapped). TRL's code is neither copied nor
changed; ``compilepack.unpatch`` puts TRL's head back.

When:

- :func:`compilepack.patch` replaces a head already on the model (head first).
- A head added after ``patch()`` (``SFTTrainer(model=compilepack.patch(model))``, the one-line road): ``patch()``
  wraps the adder in the TRL modules imported then, so the head is replaced as a trainer adds it, on patched models
  only (unpatched ones get TRL's head untouched). The one-line road has imported ``SFTTrainer`` before it calls it.
- :func:`with_routed_head` (``with_routed_head(SFTTrainer)(model=compilepack.patch(model), ...)``): the explicit
  road. The trainer class replaces the head at the end of its ``__init__``, whatever TRL had imported when
  ``patch()`` ran.

A head compilepack does not recognise (its options or arguments differ from what compilepack reproduces) is left as
TRL made it, with one :class:`UnroutedTrlHeadWarning`; :func:`compilepack.explain` shows its breaks.

Which TRL (pyproject's ``test`` extra admits 1.14.2 and 1.16): 1.0 to 1.4 have no head; 1.5 to 1.14 add a chunked
cross-entropy head for ``SFTConfig(loss_type="chunked_nll")`` (1.14's default, ``_patch_chunked_ce_lm_head``),
replaced the same way; 1.15's fused head is not admitted; 1.16's fused head is replaced. The seams TRL would need for
this to take no wrap at all are in docs/integrations.md ("Seams").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import types
import warnings

import torch

from ..batch.keys import IGNORE_INDEX
from ..errors import CompilepackError
from ..ops.lm_head import lm_head_logprobs
from ..patching.api import ModelExtension, is_patched, register_extension

PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # FusedCausalLMOutput's fields


@dataclasses.dataclass(frozen=True)
class HeadKind:
    """An LM head a TRL trainer installs as the model's instance ``forward``, as compilepack recognises it."""

    module: str  # the TRL module that defines it
    adder: str  # the function there that installs it on a model
    head: str  # the name of the forward it installs (a function nested in ``adder``)
    options: frozenset  # the head's closure variables: recognised only when exactly these
    parameters: tuple  # the head's parameters after ``self``
    output: str  # the output class, in ``module``
    releases: str


FUSED_HEAD = HeadKind(  # add_fused_lm_head: SFTTrainer always (and the GRPO, DPO, ... trainers)
    "trl.trainer.utils", "add_fused_lm_head", "_fused_forward",
    frozenset({"backbone_attr", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale", "original_forward",
               "outputs", "temperature", "text_config"}),
    ("fused_lm_head", "labels", "shift_labels", "num_items_in_batch"),
    "FusedCausalLMOutput", "1.16",
)
CHUNKED_CE_HEAD = HeadKind(  # SFTTrainer's loss_type="chunked_nll" (the default in 1.14)
    "trl.trainer.sft_trainer", "_patch_chunked_ce_lm_head", "_chunked_ce_forward",
    frozenset({"chunk_size", "final_logit_softcapping", "is_vlm", "lm_head", "logit_scale", "original_forward",
               "text_config"}),
    ("input_ids", "attention_mask", "labels", "num_items_in_batch", "shift_labels", "output_router_logits"),
    "_ChunkedCELMHeadOutput", "1.5 to 1.14",
)
HEADS = (FUSED_HEAD, CHUNKED_CE_HEAD)


class UnroutedTrlHeadWarning(UserWarning):
    """TRL's LM head was left as TRL made it: correct, but a compiled step breaks its graph there."""


class RoutedFusedHead:
    """The instance ``forward`` compilepack puts in place of TRL's head: compilepack's forward of that head's kind,
    with TRL's ``options``. Same call and ``inspect.signature`` as TRL's head; ``trl_forward`` is TRL's own, which
    answers calls without the head (and :func:`unroute` puts back)."""

    __slots__ = ("kind", "module", "options", "trl_forward")

    def __init__(self, kind: HeadKind, module: torch.nn.Module, trl_forward, options: dict):
        self.kind, self.module, self.trl_forward, self.options = kind, module, trl_forward, options

    def __call__(self, *args, **kwargs):
        forward = _fused_forward if self.kind is FUSED_HEAD else _chunked_ce_forward
        return forward(self, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.trl_forward)

    @property
    def __wrapped__(self):
        return self.trl_forward

    def __reduce__(self):
        # TRL's head is a closure over this very model (its non-fused path calls the forward it replaced): a copy
        # would call the original model, and pickle restores only the class's forward. Neither is silently allowed.
        raise CompilepackError(
            f"cannot pickle or copy {type(self.module).__name__} while it carries TRL's fused LM head (routed by "
            "compilepack): TRL's head is a closure over the original model, so a copy would silently run the "
            "original. Save weights with save_pretrained()/state_dict(), or copy the model before the trainer adds "
            "its head (then compilepack.patch the copy)."
        )

    def __repr__(self) -> str:
        return f"<TRL {self.kind.head} of {type(self.module).__name__}, routed to compilepack::lm_head_logprobs>"


# ------------------------------------------------------------------------------------------------ recognising


def head_kind(forward) -> HeadKind | None:
    """Which TRL head ``forward`` (a module's instance ``forward``) is: a method bound by TRL's adder, whose
    function is the head nested in it; None if none."""
    function = getattr(forward, "__func__", None)
    if not isinstance(forward, types.MethodType) or not isinstance(function, types.FunctionType):
        return None
    defined_in = function.__globals__.get("__name__")
    # co_name: functools.wraps gives the head the model's forward's __name__ and __qualname__, not its code's
    return next((k for k in HEADS if k.module == defined_in and function.__code__.co_name == k.head), None)


def is_trl_head(forward) -> bool:
    """Whether ``forward`` (a module's instance ``forward``) is an LM head a TRL trainer installed."""
    return head_kind(forward) is not None


def trl_options(forward) -> dict:
    """The options a TRL head was added with, as its closure holds them (``temperature``, ``outputs``, ...)."""
    function = forward.__func__
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())}


def route(module: torch.nn.Module) -> bool:
    """Put compilepack's forward in place of the TRL head on ``module`` (its instance ``forward``); True if it did.
    A head compilepack does not recognise is left alone, with one :class:`UnroutedTrlHeadWarning` per process.

    Raises:
        CompilepackError: DeepSpeed ZeRO-3 is enabled.
    """
    forward = module.__dict__.get("forward")
    kind = head_kind(forward)
    if kind is None or not _recognised(kind, forward):
        return False
    _refuse_zero3()
    module.forward = RoutedFusedHead(kind, module, forward, trl_options(forward))
    return True


def unroute(module: torch.nn.Module) -> bool:
    """Put TRL's own head back on ``module``; True if it carried a routed one."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, RoutedFusedHead):
        return False
    module.forward = forward.trl_forward
    return True


def route_all(model: torch.nn.Module) -> int:
    """Route every TRL head within ``model`` (a PEFT wrapper's base model included); returns how many."""
    return sum(route(module) for module in model.modules())


def unroute_all(model: torch.nn.Module) -> int:
    return sum(unroute(module) for module in model.modules())


def _recognised(kind: HeadKind, forward) -> bool:
    """Whether compilepack reproduces this head (its options and arguments are those it knows); if not, warn once."""
    options = set(trl_options(forward))
    code = forward.__func__.__code__  # the head's own parameters (TRL gives it the model's signature to show)
    parameters = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
    problem = None
    if options != kind.options:
        problem = f"its options differ: {sorted(options ^ kind.options)}"
    elif parameters != kind.parameters:
        problem = f"it takes {parameters}, not {kind.parameters}"
    elif not hasattr(sys.modules[kind.module], kind.output):
        problem = f"{kind.module} has no {kind.output}"
    if problem is not None:
        _warn_unrouted(kind, problem)
    return problem is None


_warned_versions: set[str] = set()


def _warn_unrouted(kind: HeadKind, problem: str) -> None:
    import trl

    if trl.__version__ in _warned_versions:
        return
    _warned_versions.add(trl.__version__)
    routed = " and ".join(f"TRL {k.releases}'s {k.head}" for k in HEADS)
    warnings.warn(
        f"compilepack does not recognise TRL {trl.__version__}'s LM head {kind.head} ({problem}), so it is left as TRL "
        f"made it: the loss stays TRL's own, but a compiled training step will break the graph there "
        f"(compilepack.explain(model, batch) shows the breaks). compilepack replaces {routed} with its own one-graph "
        f"forward: install one of those for a compiled SFTTrainer (pip install 'trl=={FUSED_HEAD.releases}.*'), or "
        "silence compilepack.integrations.trl.UnroutedTrlHeadWarning to train with TRL's head.",
        UnroutedTrlHeadWarning,
        stacklevel=3,
    )


def _refuse_zero3() -> None:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise CompilepackError(
            "cannot route TRL's fused LM head under DeepSpeed ZeRO-3: the gathered lm_head weight is partitioned "
            "again before compilepack's op recomputes the logits in the backward. Use FSDP2 (fully_shard), ZeRO-2, "
            "or leave the model unpatched."
        )


# ------------------------------------------------------------------------------------------------ the forwards


def _fused_forward(head: RoutedFusedHead, *args, fused_lm_head=False, labels=None, shift_labels=None,
                   num_items_in_batch=None, **kwargs):
    """TRL 1.16's ``_fused_forward`` (trl/trainer/utils.py), every position scored by compilepack's op."""
    if not fused_lm_head:
        return head.trl_forward(*args, labels=labels, shift_labels=shift_labels,
                                num_items_in_batch=num_items_in_batch, **kwargs)
    model, options = head.module, head.options
    text_config = options["text_config"]
    kwargs["use_cache"] = False
    if getattr(text_config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    backbone = getattr(model, options["backbone_attr"])(*args, **kwargs)
    hidden, targets = _shifted(backbone.last_hidden_state, labels, shift_labels)
    lm_head = model.get_output_embeddings()  # looked up at every call, as TRL does: FSDP and PEFT replace it
    hidden, targets = hidden.to(lm_head.weight.device), targets.to(lm_head.weight.device)
    mask = targets != IGNORE_INDEX
    precision = contextlib.nullcontext()
    if options["cast_lm_head_to_fp32"]:
        hidden, precision = hidden.float(), torch.autocast(hidden.device.type, enabled=False)
    with precision:
        stats = lm_head_logprobs(
            hidden.reshape(-1, hidden.size(-1)), _full(lm_head.weight), _full(lm_head.bias),
            targets.clamp(min=0).reshape(-1), logit_scale=options["logit_scale"],
            softcap=options["final_logit_softcapping"], temperature=options["temperature"],
            stats=tuple(name for name in options["outputs"] if name != "log_probs"),
        )
    per_token = {name: _masked(getattr(stats, name), mask) for name in PER_TOKEN}
    loss = -per_token["log_probs"].sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None
                                             else num_items_in_batch)
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _load_balancing(text_config, backbone.router_logits, kwargs.get("attention_mask"))
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    output = getattr(sys.modules[FUSED_HEAD.module], FUSED_HEAD.output)
    return output(loss=loss, **per_token, label_mask=mask, aux_loss=aux_loss)


def _chunked_ce_forward(head: RoutedFusedHead, input_ids=None, attention_mask=None, labels=None,
                        num_items_in_batch=None, shift_labels=None, output_router_logits=None, **kwargs):
    """TRL 1.5-1.14's ``_chunked_ce_forward`` (trl/trainer/sft_trainer.py) with compilepack's op: the same loss,
    correct-token count, entropy sum and valid-token count (TRL's loop over a number of chunks read from the data
    breaks the graph; the op tiles tokens, a whole vocabulary row at a time)."""
    if labels is None and shift_labels is None:
        return head.trl_forward(input_ids=input_ids, attention_mask=attention_mask,
                                output_router_logits=output_router_logits, **kwargs)
    options = head.options
    text_config = options["text_config"]
    if output_router_logits is None:
        output_router_logits = getattr(text_config, "output_router_logits", False)
    kwargs.pop("use_cache", None)
    if output_router_logits:
        kwargs["output_router_logits"] = True
    backbone = head.module.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    hidden, targets = _shifted(backbone.last_hidden_state, labels, shift_labels)
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1).to(hidden.device)
    lm_head = options["lm_head"]  # TRL's head reads the module it found when it was added
    stats = lm_head_logprobs(hidden, _full(lm_head.weight), _full(lm_head.bias), targets,
                             logit_scale=options["logit_scale"], softcap=options["final_logit_softcapping"],
                             stats=("entropy", "is_top1"))
    valid = targets != IGNORE_INDEX
    num_valid = valid.sum()
    loss = -stats.log_probs.sum()  # 0 where the target is ignored
    if num_items_in_batch is None:
        loss = loss / num_valid.clamp(min=1)
    else:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    aux_loss = None
    if output_router_logits:
        aux_loss = _load_balancing(text_config, backbone.router_logits, attention_mask)
        loss = loss + text_config.router_aux_loss_coef * aux_loss.to(loss.device)
    output = getattr(sys.modules[CHUNKED_CE_HEAD.module], CHUNKED_CE_HEAD.output)
    return output(loss=loss, logits=None, hidden_states=backbone.hidden_states, past_key_values=None,
                  attentions=None, num_correct_tokens=(stats.is_top1 & valid).sum().float(),
                  entropy_sum=(stats.entropy * valid).sum(), num_valid_tokens=num_valid, aux_loss=aux_loss)


def _shifted(hidden: torch.Tensor, labels, shift_labels) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, their targets): ``labels`` shifted by one, or ``shift_labels`` (pre-shifted) as they are."""
    if shift_labels is None:
        return hidden[:, :-1], labels[:, 1:]
    return hidden, shift_labels


def _masked(value: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else value.view(mask.shape).masked_fill(~mask, 0)


def _full(parameter: torch.Tensor | None) -> torch.Tensor | None:
    """FSDP2's sharded parameter gathered once (a DTensor), as TRL's head does; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return parameter.full_tensor() if isinstance(parameter, DTensor) else parameter


def _load_balancing(text_config, router_logits, attention_mask) -> torch.Tensor:
    """TRL's MoE aux loss: Mixtral's ``load_balancing_loss_func``, which every MoE family shares (TRL's exceptions
    for transformers < 5.6 do not apply in compilepack's range)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(router_logits, text_config.num_experts, text_config.num_experts_per_tok,
                                    attention_mask)


# ------------------------------------------------------------------------------------------------ when


def hook_trl_heads() -> bool:
    """Wrap the function that installs each TRL head, in every imported ``trl`` module that holds it (TRL's trainer
    modules import ``add_fused_lm_head`` by name), so that a head added to a compilepack-patched model is routed as it
    is added. Idempotent; a TRL module imported later imports the wrapped function from ``trl.trainer.utils``.
    Returns whether any wrap is in place (False when TRL is not imported, or installs no head)."""
    hooked_any = False
    for kind in HEADS:
        original = getattr(sys.modules.get(kind.module), kind.adder, None)
        if original is None:  # TRL not imported, or this TRL has no such head (1.0-1.14: no fused head)
            continue
        original = getattr(original, "__compilepack_original__", original)
        hooked = _hooked(original)
        for name, holder in list(sys.modules.items()):
            if (name == "trl" or name.startswith("trl.")) and getattr(holder, kind.adder, None) is original:
                setattr(holder, kind.adder, hooked)
        hooked_any = True
    return hooked_any


@functools.cache
def _hooked(original):
    @functools.wraps(original)
    def add_head(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        _route_added(model)
        return result

    add_head.__compilepack_original__ = original
    return add_head


def _route_added(model: torch.nn.Module) -> None:
    """After TRL added its head to ``model``: route it if compilepack patched the model. A compiled model
    (``torch.compile(patched)`` handed to the trainer) got the head on its ``OptimizedModule``, whose own forward
    would then bypass the compiled code: the head moves to the model inside, which the compiled code calls."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        inner, head = model._orig_mod, model.__dict__.get("forward")
        if is_patched(inner) and head_kind(head) is FUSED_HEAD and _recognised(FUSED_HEAD, head):
            options = trl_options(head)
            model.forward = options["original_forward"]  # the compiled forward TRL replaced comes back
            add_fused_lm_head = getattr(sys.modules[FUSED_HEAD.module], FUSED_HEAD.adder)
            add_fused_lm_head = getattr(add_fused_lm_head, "__compilepack_original__", add_fused_lm_head)
            add_fused_lm_head(inner, temperature=options["temperature"],
                              cast_lm_head_to_fp32=options["cast_lm_head_to_fp32"], outputs=options["outputs"])
            route(inner)
    elif is_patched(model):
        route_all(model)


def with_routed_head(trainer_class: type) -> type:
    """``with_routed_head(SFTTrainer)``: the trainer class whose ``__init__`` ends by putting compilepack's forward in
    place of the LM head TRL added to its compilepack-patched model (what ``patch()`` does anyway when TRL was
    imported first; this road needs no wrap of TRL's adder). Works for any TRL trainer class that adds its head in
    ``__init__`` (SFT, DPO, GRPO, ...); the model must be patched before the trainer is built.

    Example::

        trainer = with_routed_head(SFTTrainer)(model=compilepack.patch(model), args=SFTConfig(...), ...)
    """

    class RoutedHead(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for model in (self.model, getattr(self, "ref_model", None)):
                if isinstance(model, torch.nn.Module):
                    _route_added(model)

    RoutedHead.__name__ = RoutedHead.__qualname__ = f"RoutedHead{trainer_class.__name__}"
    RoutedHead.__module__, RoutedHead.__doc__ = trainer_class.__module__, trainer_class.__doc__
    return RoutedHead


def _route_now_and_later(model: torch.nn.Module, **options) -> None:
    hook_trl_heads()  # a head a TRL trainer adds later is routed as it is added
    route_all(model)  # a head it already added is routed now


register_extension(ModelExtension("TRL fused LM head", install=_route_now_and_later, remove=unroute_all))
