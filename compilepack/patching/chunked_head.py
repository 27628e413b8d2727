"""A causal LM whose loss never holds the ``[T, V]`` logits: ``compilepack.patch(model, lm_head="chunked")``.

The stock causal-LM forward computes ``logits = lm_head(hidden)`` for every token, and its loss upcasts them to fp32:
at a 248k vocabulary and 4,096 packed tokens the logits, their fp32 copy and their gradient take 12 GB, ten times
the model's weights (Qwen3.5-0.8B widths). With the chunked head, a forward **given labels** runs the backbone,
then scores the targets through ``compilepack::lm_head_logprobs`` a chunk of tokens at a time (its extra memory
does not grow with ``T``), and returns the loss ``ForCausalLMLoss`` would: the same ``labels`` shifting,
``shift_labels`` (pre-shifted, as context-parallel shards pass them), ``num_items_in_batch`` (gradient accumulation:
HF Trainer passes it) and ``ignore_index``, plus what the family's forward adds to its loss (MoE load balancing,
Bamba's z-loss).

What ``logits`` then carries: ``None`` (never a stale or partial tensor); ask for them by calling without
``labels``. Calls without ``labels`` (generation, evaluation without labels) run the stock forward, logits and all.

Works with HF ``Trainer`` as is (its ``compute_loss`` reads ``outputs.loss``), compiled to one graph
(``torch.compile(model, fullgraph=True, dynamic=True)``), with PEFT (LoRA on the LM head included: the adapter's
low-rank update joins the head's weight inside the graph), and through pickling, ``torch.save`` and ``deepcopy``.
``compilepack.unpatch`` removes it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

import torch
import torch.nn.functional as F

from ..batch.keys import CACHE_KEYS, IGNORE_INDEX, LABELS, NUM_ITEMS_IN_BATCH, SHIFT_LABELS
from ..errors import CompilepackError, IncompatibleTransformersError
from ..ops.lm_head import default_chunk_tokens, lm_head_logprobs
from .api import ModelExtension, register_extension
from .rebind import innermost

CHUNKED = "chunked"
LM_HEADS = (CHUNKED,)

@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """What one causal-LM class's forward does around its LM head, read once from its source."""

    backbone: str  # attribute of the backbone (``base_model_prefix``)
    parameters: tuple[str, ...]  # the forward's parameters, without self (to name positional arguments)
    # the scale the forward applies to the head's output: (attribute path from the model, divided by it?), or None
    scaling: tuple[tuple[str, ...], bool] | None
    z_loss: bool  # Bamba: ``loss + z_loss_coefficient * mean(logsumexp(logits) ** 2)``
    load_balancing: object  # MoE: the modeling module's ``load_balancing_loss_func``, or None
    # MoE: where the forward reads the experts, experts per token and the aux-loss coefficient, as attribute paths
    # from the model (``("config", "text_config", "num_experts")``), read at every call as the forward reads them
    balancing_paths: tuple[tuple[str, ...], ...] = ()


class ChunkedCausalLMForward:
    """The instance ``forward`` of a causal LM with the chunked head. Same call and ``inspect.signature`` as the
    stock forward; pickles as "the chunked head of this module" (rebuilt when loaded)."""

    __slots__ = ("chunk_tokens", "module", "plan")

    def __init__(self, module: torch.nn.Module, chunk_tokens: int | None = None):
        self.module, self.chunk_tokens, self.plan = module, chunk_tokens, plan_of(type(module))

    def __call__(self, *args, **kwargs):
        return _forward(self, *args, **kwargs)

    def __reduce__(self):
        return ChunkedCausalLMForward, (self.module, self.chunk_tokens)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __repr__(self) -> str:
        return f"<compilepack chunked LM head of {type(self.module).__name__}>"


def install(model: torch.nn.Module, lm_head: str = CHUNKED, *, chunk_tokens: int | None = None) -> torch.nn.Module:
    """Give ``model``'s causal LM (inside a PEFT wrapper too) the chunked LM head and loss; idempotent.

    Raises:
        ValueError: ``lm_head`` is not one of ``LM_HEADS``, or ``chunk_tokens`` is not positive.
        CompilepackError: no causal LM with an ``lm_head`` in ``model``, or its forward was already replaced by
            another tool.
        IncompatibleTransformersError: the class's forward computes its logits in a way the chunked head does not
            reproduce (the message quotes the line).
    """
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head={lm_head!r} is not known; expected one of {list(LM_HEADS)} (or None: stock head).")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens}.")
    target = causal_lm_of(model)
    current = target.__dict__.get("forward")
    if isinstance(current, ChunkedCausalLMForward):
        if chunk_tokens is not None:  # patch() again keeps a chunk size set before
            current.chunk_tokens = chunk_tokens
        return model
    if type(current).__name__ == "PatchedForward":  # the family patches the causal LM itself (Mamba stacks)
        raise CompilepackError(
            f"the chunked LM head does not support {type(target).__name__} yet: compilepack patches that causal LM's "
            "own forward (to pass the boundaries to its backbone), and the chunked head would replace it. Leave "
            "lm_head unset for this family."
        )
    if current is not None:
        raise CompilepackError(
            f"{type(target).__name__} already has an instance-level forward ({current!r}) set by another tool (TRL's "
            "fused head, accelerate hooks, ...): compilepack will not stack its LM head on it. Install the chunked "
            "head first (compilepack.patch(model, lm_head='chunked') before the other tool), or leave it out."
        )
    target.forward = ChunkedCausalLMForward(target, chunk_tokens)
    return model


def remove(model: torch.nn.Module) -> bool:
    """Remove the chunked head from every module of ``model``; True if there was one."""
    found = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), ChunkedCausalLMForward)]
    for module in found:
        del module.__dict__["forward"]
    return bool(found)


def has_chunked_head(model: torch.nn.Module) -> bool:
    return any(isinstance(m.__dict__.get("forward"), ChunkedCausalLMForward) for m in model.modules())


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost module of ``model`` that is a causal LM with an ``lm_head`` and a ``labels`` parameter."""
    from transformers import PreTrainedModel

    for module in model.modules():  # a PEFT wrapper is not a PreTrainedModel: the causal LM inside it is found
        causal_lm = isinstance(module, PreTrainedModel) and LABELS in inspect.signature(type(module).forward).parameters
        if causal_lm and module.get_output_embeddings() is not None:
            return module
    raise CompilepackError(
        f"{type(model).__name__} holds no causal LM with an lm_head (a ...ForCausalLM taking labels): the chunked LM "
        "head replaces such a model's logits and loss. Pass the causal LM (or its PEFT wrapper)."
    )


def plan_of(cls: type) -> HeadPlan:
    """Read what ``cls.forward`` does around its LM head; refuse what the chunked head would not reproduce."""
    forward = innermost(cls.forward)
    where = f"{cls.__module__}.{cls.__qualname__}.forward"
    scaling = _logit_scaling(forward, where)
    uses = set(forward.__code__.co_names)
    balancing, paths = None, ()
    if "load_balancing_loss_func" in uses:
        balancing = importlib.import_module(cls.__module__).load_balancing_loss_func
        paths = _balancing_paths(forward, where)
    prefix = getattr(cls, "base_model_prefix", "model")
    return HeadPlan(prefix, tuple(inspect.signature(forward).parameters)[1:], scaling, "z_loss_coefficient" in uses,
                    balancing, paths)


def _logit_scaling(forward, where: str) -> tuple[tuple[str, ...], bool] | None:
    """How ``forward``'s ``logits = ...`` statements turn the hidden states into logits, read from their syntax (not
    their spelling): ``self.lm_head`` applied once to ``hidden_states`` (the states and the result sliced or cast in
    any way: the chunked head scores every position, in the head's dtype), scaled at most once by an attribute of
    the model (``* self.model.lm_head_multiplier``, ``logits / self.config.logits_scaling``). Returns that scale's
    (attribute path, divided?), or None. Anything else (a softcap, a constant, a second head) is refused: the chunked
    head would compute another loss than the model's own."""
    statements = _logits_assignments(forward)
    heads = [value for value in statements if _is_head(value)]
    scalings = [scaling for value in statements if (scaling := _scaling(value)) is not None]
    known = len(heads) + len(scalings) == len(statements)
    applies_head_once = len(heads) + sum(operand == "head" for *_, operand in scalings) == 1
    if not (known and applies_head_once and len(scalings) <= 1):
        raise IncompatibleTransformersError(
            f"compilepack's chunked LM head cannot reproduce {where}: it computes its logits as "
            f"{['logits = ' + ast.unparse(value) for value in statements]!r}, which the chunked head does not know. "
            "Leave lm_head unset (stock head) for this model."
        )
    return scalings[0][:2] if scalings else None


def _is_head(node) -> bool:
    """``self.lm_head(hidden_states)``, the states and the result sliced or cast (``hidden_states[:, slice_indices]``,
    ``.to(dtype)``, ``.float()``) in any way."""
    node = _uncast(node)
    if not (isinstance(node, ast.Call) and _self_path(node.func) == ("lm_head",) and len(node.args) == 1
            and not node.keywords):
        return False
    inner = _uncast(node.args[0])
    while isinstance(inner, ast.Subscript):
        inner = _uncast(inner.value)
    return isinstance(inner, ast.Name) and inner.id == "hidden_states"


def _scaling(node) -> tuple[tuple[str, ...], bool, str] | None:
    """``<the head> * self.a.b`` or ``logits / self.a.b`` -> (("a", "b"), divided?, "head" or "logits"); None for
    anything else."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div))):
        return None
    path, left = _self_path(node.right), _uncast(node.left)
    operand = "head" if _is_head(left) else "logits" if isinstance(left, ast.Name) and left.id == "logits" else None
    return None if path is None or operand is None else (path, isinstance(node.op, ast.Div), operand)


def _uncast(node):
    """``x.float()``, ``x.to(...)`` -> ``x``."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("float", "to"):
        node = node.func.value
    return node


def _balancing_paths(forward, where: str) -> tuple[tuple[str, ...], ...]:
    """The attribute paths of ``load_balancing_loss_func(router_logits, <experts>, <per token>, mask)``'s second and
    third arguments and of the coefficient in ``loss += <coefficient> * aux_loss...``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "load_balancing_loss_func"]
    adds = [n.value.left for n in ast.walk(tree) if isinstance(n, ast.AugAssign) and ast.unparse(n.target) == "loss"
            and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Mult)]
    if len(calls) != 1 or len(calls[0].args) < 3 or len(adds) != 1:
        raise IncompatibleTransformersError(f"compilepack's chunked LM head cannot find how {where} weighs its MoE "
                                            "load-balancing loss; leave lm_head unset for this model.")
    paths = [_self_path(node) for node in (*calls[0].args[1:3], adds[0])]
    if None in paths:
        raise IncompatibleTransformersError(f"compilepack's chunked LM head cannot read {where}'s MoE load-balancing "
                                            "arguments (not attributes of the model); leave lm_head unset.")
    return tuple(paths)


def _self_path(node) -> tuple[str, ...] | None:
    """``self.a.b`` -> ``("a", "b")``; None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return tuple(reversed(names)) if isinstance(node, ast.Name) and node.id == "self" and names else None


def _read(model, path: tuple[str, ...]):
    for name in path:
        model = getattr(model, name)
    return model


def _logits_assignments(function) -> list[ast.expr]:
    """The value of every ``logits = ...`` statement of the function."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "logits" for t in node.targets)]


# ------------------------------------------------------------------------------------------------ the forward


def _forward(head: ChunkedCausalLMForward, *args, **kwargs):
    model, plan = head.module, head.plan
    kwargs.update(zip(plan.parameters, args))  # positional arguments by name (static: the forward's own order)
    if kwargs.get(LABELS) is None:
        return type(model).forward(model, **kwargs)  # generation, evaluation without labels: stock, logits and all
    labels = kwargs.pop(LABELS)
    if not _keeps_all(kwargs.pop("logits_to_keep", 0)):
        raise ValueError("logits_to_keep must be 0 (every position) when labels are given to the chunked LM head: "
                         "the loss scores every labelled position. Drop logits_to_keep, or call without labels.")
    if plan.load_balancing is not None and kwargs.get("output_router_logits") is None:
        kwargs["output_router_logits"] = model.config.get_text_config().output_router_logits
    outputs = getattr(model, plan.backbone)(**kwargs)
    hidden = outputs.last_hidden_state
    loss, log_z = _loss(head, hidden, labels, kwargs)
    if plan.z_loss and model.z_loss_coefficient > 0:
        loss = loss + model.z_loss_coefficient * log_z.to(loss.dtype).pow(2).mean()
    extra = {}
    if plan.load_balancing is not None:
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast as Output

        aux_loss = None
        if kwargs["output_router_logits"]:
            experts, per_token, coefficient = (_read(model, path) for path in plan.balancing_paths)
            aux_loss = plan.load_balancing(outputs.router_logits, experts, per_token, kwargs.get("attention_mask"))
            loss = loss + coefficient * aux_loss.to(loss.device)
        extra = {"aux_loss": aux_loss, "router_logits": outputs.router_logits}
    else:
        from transformers.modeling_outputs import CausalLMOutputWithPast as Output
    # the cache field is ``past_key_values`` up to transformers 5.23 and ``cache`` from 5.24 (as CACHE_KEYS says)
    cache_field = next(key for key in CACHE_KEYS if key in Output.__dataclass_fields__)
    return Output(loss=loss, logits=None, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                  **{cache_field: getattr(outputs, cache_field, None)}, **extra)


def _loss(head: ChunkedCausalLMForward, hidden: torch.Tensor, labels: torch.Tensor, kwargs: dict):
    """``ForCausalLMLoss`` on the chunked statistics: (loss, log_z per position)."""
    ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
    shift_labels = kwargs.get(SHIFT_LABELS)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if targets.shape[0] != flat.shape[0]:
        raise ValueError(f"{SHIFT_LABELS if kwargs.get(SHIFT_LABELS) is not None else LABELS} has "
                         f"{targets.shape[0]} positions but the model returned {flat.shape[0]} hidden states; labels "
                         "must have the shape of input_ids.")
    weight, bias = head_parameters(head.module.get_output_embeddings())
    chunk = head.chunk_tokens or default_chunk_tokens(weight.shape[0])
    scale = _scale(head.module, head.plan.scaling)
    stats = lm_head_logprobs(flat, weight, bias, targets, ignore_index=ignore_index, chunk_tokens=chunk,
                             logit_scale=scale)
    total = -stats.log_probs.sum()
    num_items = kwargs.get(NUM_ITEMS_IN_BATCH)
    if num_items is None:
        return total / (targets != ignore_index).sum(), stats.log_z  # the mean: nan without targets, as stock
    if torch.is_tensor(num_items):
        num_items = num_items.to(total.device)
    return total / num_items, stats.log_z


def _scale(model: torch.nn.Module, scaling: tuple[tuple[str, ...], bool] | None) -> float:
    if scaling is None:
        return 1.0
    path, divided = scaling
    return 1.0 / _read(model, path) if divided else _read(model, path)


def head_parameters(lm_head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the LM head as its forward applies them. A PEFT LoRA layer gives its base weight plus each
    active adapter's ``scaling * B @ A`` (exact for a LoRA without dropout: the update is linear)."""
    if type(lm_head) is torch.nn.Linear:
        return lm_head.weight, lm_head.bias
    base = getattr(lm_head, "base_layer", None)
    if isinstance(base, torch.nn.Linear) and hasattr(lm_head, "lora_A"):
        if getattr(lm_head, "merged", False) or getattr(lm_head, "disable_adapters", False):
            return base.weight, base.bias
        weight = base.weight
        with torch.autocast(weight.device.type, enabled=False):  # the update in the weight's dtype, as PEFT keeps it
            for name in lm_head.active_adapters:
                if name not in lm_head.lora_A:
                    continue
                _refuse_lora_options(lm_head, name)
                update = lm_head.lora_B[name].weight @ lm_head.lora_A[name].weight
                weight = weight + update.to(weight.dtype) * lm_head.scaling[name]
        return weight, base.bias
    raise CompilepackError(
        f"the chunked LM head needs a plain nn.Linear LM head (or a PEFT LoRA layer over one); this model's is "
        f"{type(lm_head).__name__}. Leave lm_head unset for this model."
    )


def _refuse_lora_options(layer, name: str) -> None:
    dropout = layer.lora_dropout[name]
    if layer.training and not isinstance(dropout, torch.nn.Identity) and getattr(dropout, "p", 0) > 0:
        raise CompilepackError(
            f"LoRA adapter {name!r} on the LM head has dropout {dropout.p}: its update then depends on the tokens and "
            "cannot join the head's weight. Set lora_dropout=0 for the LM head (or leave lm_head out of "
            "target_modules) to use the chunked LM head."
        )
    if getattr(layer, "use_dora", {}).get(name) or layer.lora_B[name].bias is not None:
        raise CompilepackError(f"LoRA adapter {name!r} on the LM head uses DoRA or a LoRA bias, which the chunked LM "
                               "head does not reproduce. Leave lm_head out of target_modules.")


def _keeps_all(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def _check_option(lm_head: str | None = None, **options) -> None:
    if lm_head is not None and lm_head not in LM_HEADS:
        raise ValueError(f"lm_head={lm_head!r} is not known; expected one of {list(LM_HEADS)}, or None (stock head).")


def _install_option(model: torch.nn.Module, lm_head: str | None = None, **options) -> None:
    if lm_head is not None:
        install(model, lm_head)


register_extension(
    ModelExtension("chunked LM head", install=_install_option, remove=remove, options=("lm_head",), check=_check_option)
)
