"""TRL's fused LM head, made to compile to one graph: routed to ``compilepack::lm_head_logprobs``.

TRL 1.16's trainers (``SFTTrainer`` always) install a fused LM head with ``trl.trainer.utils.add_fused_lm_head``: it
replaces the causal LM's ``forward`` with ``_fused_forward``, which, called with ``fused_lm_head=True``, runs the
backbone and scores the tokens through ``ChunkedLogProbFunction``, without the ``[T, V]`` logits. That function
breaks dynamo's graph twice (its torch fallback calls ``torch.mm(..., out=tile)`` on a non-contiguous tile, and
loops over token and vocabulary tiles in Python), so a compiled SFTTrainer step ran 3 graphs with 2 breaks.

Routing keeps TRL's own ``_fused_forward`` (its arguments, its shifting of ``labels`` and ``shift_labels``, its MoE
aux loss, its ``FusedCausalLMOutput``): compilepack copies the function with three of its global loads renamed
(as it patches transformers' layers, ``compilepack.patching.rebind``):

- ``ChunkedLogProbFunction`` -> :class:`ChunkedLogProb`, the same statistics from compilepack's custom op (one
  opaque node with a fake and an explicit backward: no break, no recompile as ``T`` changes);
- ``_use_triton`` -> always False: every position is scored, labels ``-100`` masked after, so shapes never depend
  on how many labels a batch has (TRL's compact path on CUDA indexes ``hidden[mask]``, a data-dependent shape);
- ``maybe_gather_lm_head_ctx`` -> a null context (DeepSpeed ZeRO-3 is refused at routing time: its gathered
  weight would be partitioned again before the op's backward reads it).

When: :func:`compilepack.patch` routes a head it finds on the model (head added first), and wraps TRL's
``add_fused_lm_head`` (in every imported ``trl`` module that holds it, or, when TRL is imported after ``patch``, as
``trl.trainer.utils`` is imported) so that a head added to a patched model later is routed as it is added (patch
first). The wrapper changes nothing for a model compilepack did not patch. ``compilepack.unpatch`` puts TRL's own
head back. A head left unrouted is never hidden: :func:`compilepack.explain` shows its two breaks.

Which TRL (every 1.x release checked, 2026-12-04; docs/integrations.md, "Upstream releases"):

- 1.0 to 1.4: no head of TRL's own (SFTTrainer takes the loss from the model's forward, which compilepack patches).
- 1.5 to 1.14: no fused head, but ``SFTConfig(loss_type="chunked_nll")`` (1.14's default) installs a chunked
  cross-entropy head (``trl.trainer.sft_trainer._patch_chunked_ce_lm_head``) that loops over a number of chunks
  read from the data (a graph break): routed the same way (``_chunked_cross_entropy_loss`` ->
  :func:`chunked_cross_entropy_loss`).
- 1.15: a head compilepack does not recognise (it always scores ``hidden[mask]``, a data-dependent shape, and its
  kernel is None without Triton). Left as TRL made it, with one :class:`UnroutedTrlHeadWarning`.
- 1.16: routed. A later TRL is routed only while its head loads the same globals and its kernel takes the same
  arguments; otherwise it is left alone with the same one warning. ``patch()`` never fails for what TRL has or lacks.

Seams looked for (TRL 1.14.2, 1.15.0, 1.16.0; line numbers are 1.16.0's): compilepack renames a global only where
TRL offers no supported seam for it.

- ``_ChunkedLogProbFunction`` (the head's kernel): a registry, hook or argument that picks it. None: ``trl.kernels``
  exports the class, ``trl/trainer/utils.py:60`` imports it by name and ``_fused_forward`` reads the module global
  (utils.py:1644); ``add_fused_lm_head`` takes only ``temperature``, ``cast_lm_head_to_fp32`` and ``outputs``
  (utils.py:1548). 1.15 the same (utils.py:505, or None without Triton); 1.14 has no fused head. Renamed.
- ``_use_triton`` (score every position): an option or variable that forces the uncompacted path. None: it is
  ``_TRITON_AVAILABLE and device.type in ("cuda", "xpu")`` (``trl/kernels/chunked_logprob.py:48``); 1.15 always
  scores ``hidden[mask]`` (so its head is left unrouted). Renamed.
- ``maybe_gather_lm_head_ctx``: none needed: TRL's own is a null context without ZeRO-3 (utils.py:200), and
  ``route`` refuses ZeRO-3 first. Renamed to a null context, so that it stays one.
- ``_chunked_cross_entropy_loss`` (1.5-1.14's chunked head): an option that picks its kernel: none. 1.14 can drop the
  head, ``SFTConfig(loss_type="nll")`` (1.14.2 sft_trainer.py:1330; ``"chunked_nll"`` is the default,
  sft_config.py:334): the user's choice, and it drops the head instead of replacing its kernel. Renamed.
- The wrapped adders and the import hook (a head TRL adds after ``patch()``): an ``SFTConfig`` option that skips or
  picks the head (1.15, 1.16: none; ``SFTTrainer.__init__`` calls ``add_fused_lm_head`` unconditionally,
  sft_trainer.py:1144); ``compute_loss_func`` (1.14-1.16, deprecated from 1.15: it is given the full ``[T, V]``
  logits, and 1.16 still runs the fused head under ``no_grad`` for the metrics, sft_trainer.py:1593-1598). Two
  supported seams exist in all three releases: overriding ``SFTTrainer.compute_loss`` in a subclass (TRL's advice,
  sft_trainer.py:1052) and a ``TrainerCallback.on_train_begin`` (transformers, after the model is prepared, before
  the first step); both belong to the user's trainer, while ``patch(model)`` is given a model. Liger
  (``use_liger_kernel``; 1.15-1.16 refuse its fused linear cross-entropy, sft_trainer.py:1135) and Hub kernels
  (``model_init_kwargs={"use_kernels": True}``) replace layers, not the head. The wrap stays; the import hook
  serves only ``patch()`` before ``import trl`` and leaves ``sys.meta_path`` as soon as ``trl.trainer.utils`` loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import importlib.abc
import importlib.util
import inspect
import sys
import types
import warnings

import torch

from ..errors import CompilepackError
from ..ops.lm_head import lm_head_logprobs
from ..patching.api import ModelExtension, is_patched, register_extension
from ..patching.rebind import private_name, renamed_copy

_KEY = "trl"


@dataclasses.dataclass(frozen=True)
class HeadKind:
    """An LM head a TRL trainer installs as the model's instance ``forward``, and how compilepack routes it."""

    module: str  # the TRL module that defines it
    adder: str  # the function there that installs it on a model
    head: str  # the name of the forward it installs (a function nested in ``adder``)
    routes: dict  # TRL global the head loads -> the name of compilepack's replacement in this module
    kernel: str  # the TRL global whose arguments compilepack's replacement takes
    kernel_parameters: tuple
    releases: str  # the TRL releases whose head this is (tests/integrations/test_trl.py runs the oldest and newest)


FUSED_HEAD = HeadKind(  # SFTTrainer always adds it (and GRPO, DPO, ... trainers)
    "trl.trainer.utils", "add_fused_lm_head", "_fused_forward",
    {"_ChunkedLogProbFunction": "ChunkedLogProb", "_use_triton": "_never", "maybe_gather_lm_head_ctx": "_no_gather"},
    "_ChunkedLogProbFunction",
    ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
     "logit_scale", "outputs"),
    "1.16",
)
CHUNKED_CE_HEAD = HeadKind(  # SFTTrainer's loss_type="chunked_nll" (the default in 1.14)
    "trl.trainer.sft_trainer", "_patch_chunked_ce_lm_head", "_chunked_ce_forward",
    {"_chunked_cross_entropy_loss": "chunked_cross_entropy_loss"},
    "_chunked_cross_entropy_loss",
    ("hidden_states", "lm_head_weight", "chunk_size", "labels", "shift_labels", "num_items_in_batch", "logit_scale",
     "final_logit_softcapping", "lm_head_bias"),
    "1.5 to 1.14",
)
HEADS = (FUSED_HEAD, CHUNKED_CE_HEAD)
TRL_UTILS = FUSED_HEAD.module


class UnroutedTrlHeadWarning(UserWarning):
    """TRL's fused LM head was left as TRL made it: correct, but a compiled step breaks its graph there."""


class ChunkedLogProb:
    """Stands in for TRL's ``ChunkedLogProbFunction``: ``apply`` takes its arguments and returns its five per-token
    outputs (``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``; None where not in
    ``outputs``), computed by ``compilepack::lm_head_logprobs``. TRL's vocabulary tile (``chunk_size``) does not
    apply: the op tiles tokens, a whole vocabulary row at a time."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=("log_probs",)):
        stats = lm_head_logprobs(
            hidden, weight, bias, targets, logit_scale=logit_scale, softcap=final_logit_softcapping,
            temperature=temperature, stats=tuple(name for name in outputs if name != "log_probs"),
        )
        return stats.log_probs, stats.entropy, stats.log_sum_sq_probs, stats.mean_logits, stats.is_top1


def _never(device) -> bool:
    return False


def _no_gather(*params):
    return contextlib.nullcontext()


class RoutedFusedHead:
    """The instance ``forward`` of a causal LM whose TRL fused head compilepack routed: TRL's ``_fused_forward``
    with compilepack's op, bound to the model. Same call and ``inspect.signature`` as TRL's head; ``trl_forward`` is
    TRL's own, which :func:`unroute` puts back."""

    __slots__ = ("function", "module", "trl_forward")

    def __init__(self, function, module: torch.nn.Module, trl_forward):
        self.function, self.module, self.trl_forward = function, module, trl_forward

    def __call__(self, *args, **kwargs):
        return self.function(self.module, *args, **kwargs)

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
        return f"<TRL fused LM head of {type(self.module).__name__}, routed to compilepack::lm_head_logprobs>"


def chunked_cross_entropy_loss(hidden_states, lm_head_weight, chunk_size, labels=None, shift_labels=None,
                               num_items_in_batch=None, logit_scale=1.0, final_logit_softcapping=None,
                               lm_head_bias=None):
    """Stands in for TRL 1.5-1.14's ``_chunked_cross_entropy_loss``: the same (loss, number of correct tokens, entropy
    sum, number of valid tokens), computed by ``compilepack::lm_head_logprobs`` over every position, ``-100`` masked
    after (TRL sorts the valid tokens first and loops over a number of chunks read from the data: a graph break).
    TRL's ``chunk_size`` does not apply: the op tiles tokens, a whole vocabulary row at a time."""
    if labels is None and shift_labels is None:
        raise ValueError("At least one of `labels` or `shift_labels` must be provided.")
    if shift_labels is None:
        hidden, targets = hidden_states[..., :-1, :], labels[..., 1:]
    else:
        hidden, targets = hidden_states, shift_labels
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    stats = lm_head_logprobs(hidden, lm_head_weight, lm_head_bias, targets, logit_scale=logit_scale,
                             softcap=final_logit_softcapping, stats=("entropy", "is_top1"))
    valid = targets != -100
    n_valid = valid.sum()
    loss = -stats.log_probs.sum()  # 0 where the target is ignored
    correct = (stats.is_top1 & valid).sum().float()
    entropy_sum = (stats.entropy * valid).sum()
    if num_items_in_batch is None:
        loss = loss / n_valid.clamp(min=1)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss, correct, entropy_sum, n_valid


def head_kind(forward) -> HeadKind | None:
    """Which TRL head ``forward`` (a module's instance ``forward``) is, as TRL's adder binds it; None if none."""
    function = getattr(forward, "__func__", None)
    if not isinstance(forward, types.MethodType) or not isinstance(function, types.FunctionType):
        return None
    for kind in HEADS:
        module = sys.modules.get(kind.module)
        if module is not None and function.__globals__ is module.__dict__ and function.__code__ in _head_codes(kind):
            return kind
    return None


def is_trl_head(forward) -> bool:
    """Whether ``forward`` (a module's instance ``forward``) is an LM head a TRL trainer installed."""
    return head_kind(forward) is not None


def route(module: torch.nn.Module) -> bool:
    """Route TRL's LM head on ``module`` (its instance ``forward``) to compilepack's op; True if it did.

    A head compilepack does not recognise (TRL 1.15's, or a later TRL's that loads other globals or passes its kernel
    other arguments) is left alone, with one :class:`UnroutedTrlHeadWarning` per process.

    Raises:
        CompilepackError: DeepSpeed ZeRO-3 is enabled.
    """
    forward = module.__dict__.get("forward")
    kind = head_kind(forward)
    if kind is None or not _recognised(kind, forward.__func__):
        return False
    _refuse_zero3()
    function = forward.__func__
    renames = _install(kind)
    routed = renamed_copy(function, renames)  # TRL's head itself: what it wraps is the model's own forward
    module.forward = RoutedFusedHead(routed, module, forward)
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


def hook_trl_heads() -> bool:
    """Wrap the function that installs each TRL head (``add_fused_lm_head`` in ``trl.trainer.utils`` and in every
    imported ``trl`` module that imported it by name; ``_patch_chunked_ce_lm_head`` in ``trl.trainer.sft_trainer``)
    so that a head added to a compilepack-patched model is routed as it is added. Idempotent. While a module is not
    imported yet, the wrap is made as it is imported (before any trainer module imports the function from it).
    Returns whether any wrap is in place now (False when this TRL installs no head: nothing to wrap)."""
    hooked_any = False
    for kind in HEADS:
        module = sys.modules.get(kind.module)
        if module is None:
            if not any(isinstance(f, _HookOnImport) and f.fullname == kind.module for f in sys.meta_path):
                sys.meta_path.insert(0, _HookOnImport(kind.module))
            continue
        original = getattr(module, kind.adder, None)
        if original is None:  # this TRL does not have this head (1.0-1.14: no fused head; 1.15 on: no chunked CE)
            continue
        original = getattr(original, "__compilepack_original__", original)
        hooked = _hooked(original)
        for name, holder in list(sys.modules.items()):
            if (name == "trl" or name.startswith("trl.")) and getattr(holder, kind.adder, None) is original:
                setattr(holder, kind.adder, hooked)
        hooked_any = True
    return hooked_any


hook_add_fused_lm_head = hook_trl_heads  # the name before TRL 1.14's chunked CE head was routed too


class _HookOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``fullname`` (a TRL module defining a head) is imported, it wraps the loader so
    that :func:`hook_trl_heads` runs right after the module's code, then leaves ``sys.meta_path``."""

    def __init__(self, fullname: str):
        self.fullname = fullname

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookingLoader(spec.loader)
        return spec


class _HookingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        hook_trl_heads()

    def __getattr__(self, name):  # get_source, get_filename, ...: the wrapped loader's
        return getattr(self.loader, name)


@functools.cache
def _hooked(original):
    @functools.wraps(original)
    def add_head(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        _route_added(model, original, args, kwargs)
        return result

    add_head.__compilepack_original__ = original
    return add_head


def _route_added(model, original, args, kwargs) -> None:
    """After TRL added its head to ``model``: route it if compilepack patched the model. A compiled model
    (``torch.compile(patched)`` handed to the trainer) got the head on its ``OptimizedModule``, whose own forward
    would then bypass the compiled code: the head moves to the model inside, which the compiled code calls."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        inner, head = model._orig_mod, model.__dict__.get("forward")
        kind = head_kind(head)
        if is_patched(inner) and kind is not None and _recognised(kind, head.__func__):
            # the compiled forward TRL replaced comes back (TRL's head kept it as the forward it wraps)
            model.forward = _replaced_forward(head)
            original(inner, *args, **kwargs)
            route(inner)
    elif is_patched(model):
        route(model)


def _replaced_forward(head):
    """The forward TRL's head replaced (the ``original_forward`` it closes over)."""
    return inspect.getclosurevars(head.__func__).nonlocals["original_forward"]


def _install(kind: HeadKind) -> dict[str, str]:
    namespace = sys.modules[kind.module].__dict__
    renames = {}
    for name, ours in kind.routes.items():
        renames[name] = private_name(_KEY, name)
        namespace[renames[name]] = globals()[ours]
    return renames


def _recognised(kind: HeadKind, function) -> bool:
    """Whether TRL's head is one compilepack routes; if not, warn once (see ``route``)."""
    problem = _unrecognised_because(kind, function)
    if problem is not None:
        _warn_unrouted(kind, problem)
    return problem is None


def _unrecognised_because(kind: HeadKind, function) -> str | None:
    loaded = {i.argval for i in dis.get_instructions(function.__code__) if i.opname == "LOAD_GLOBAL"}
    missing = sorted(set(kind.routes) - loaded)
    if missing:
        return f"its {kind.head} does not load {missing}"
    kernel = getattr(sys.modules[kind.module], kind.kernel, None)
    signature_of = kernel.forward if isinstance(kernel, type) else kernel
    if not callable(signature_of):
        return f"its {kind.kernel} is missing (TRL leaves it None without Triton)"
    parameters = tuple(inspect.signature(signature_of).parameters)
    if parameters != kind.kernel_parameters:
        return f"its {kind.kernel} takes {parameters}, not {kind.kernel_parameters}"
    return None


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
        f"(compilepack.explain(model, batch) shows the breaks). compilepack routes {routed} into one graph: install "
        f"one of those for a compiled SFTTrainer (pip install 'trl=={FUSED_HEAD.releases}.*'), or silence "
        "compilepack.integrations.trl.UnroutedTrlHeadWarning to train with TRL's head.",
        UnroutedTrlHeadWarning,
        stacklevel=3,
    )


def _head_codes(kind: HeadKind) -> tuple[types.CodeType, ...]:
    """The code objects of the head nested in TRL's adder (whatever wraps the adder)."""
    adder = getattr(sys.modules[kind.module], kind.adder, None)
    adder = getattr(adder, "__compilepack_original__", adder)
    if not isinstance(adder, types.FunctionType):  # this TRL does not have this head
        return ()
    return tuple(c for c in adder.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == kind.head)


def _refuse_zero3() -> None:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise CompilepackError(
            "cannot route TRL's fused LM head under DeepSpeed ZeRO-3: the gathered lm_head weight is partitioned "
            "again before compilepack's op recomputes the logits in the backward. Use FSDP2 (fully_shard), ZeRO-2, "
            "or leave the model unpatched."
        )


def _route_now_and_later(model: torch.nn.Module, **options) -> None:
    hook_trl_heads()  # a head a TRL trainer adds later is routed as it is added
    route_all(model)  # a head it already added is routed now


register_extension(ModelExtension("TRL fused LM head", install=_route_now_and_later, remove=unroute_all))
