"""Packed log-prob passes for TRL's preference and RL trainers: ``packed_logprobs(DPOTrainer)``,
``packed_logprobs(GRPOTrainer)``.

TRL 1.16 scores padded batches: ``DPOTrainer`` switches its ``padding_free`` off ("temporarily unavailable"),
``GRPOTrainer`` has none. Each log-prob pass calls the model with TRL's fused LM head, ``model(input_ids=[B, W],
attention_mask=[B, W], labels=[B, W], fused_lm_head=True)``, and reads ``[B, W - 1]`` per-token outputs. The
subclass :func:`packed_logprobs` makes runs every such call as one packed row instead:

- the host reads each row's one run of tokens from ``attention_mask`` (left-padded prompts, right-padded
  completions: GRPO's layout; right padding: DPO's), concatenates the runs into ``[1, N]`` and builds compilepack's
  boundaries from their lengths (``Boundaries.from_lengths``, never from positions);
- the patched model runs the packed row: every mixer (attention, linear attention, Mamba, conv) keeps the sequences
  apart, and TRL's fused head, routed to ``compilepack::lm_head_logprobs``, scores the targets (pre-shifted
  ``shift_labels``, ``-100`` at each sequence's end) a chunk of tokens at a time: no ``[T, V]`` logits;
- the per-token outputs (``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``, ``log_sum_sq_probs``) are put
  back in TRL's ``[B, W - 1]`` layout with one gather, 0 where TRL's are 0 (targets ``-100``); the trainer's loss
  code runs unchanged on them.

Which passes (the seams, TRL 1.16's line numbers):

- ``DPOTrainer``: the policy's chosen+rejected forward (``_compute_loss``, dpo_trainer.py:1299, the ``model`` it is
  given) and the reference's, through ``compute_ref_log_probs`` (1243; also what ``precompute_ref_log_probs=True``
  runs over the dataset). The reference log-probs of a step are computed first and handed to TRL's loss as
  precomputed ones (``ref_chosen_logps`` / ``ref_rejected_logps``): the same sums, ``ld_alpha`` included.
- ``GRPOTrainer``: ``_get_per_token_logps_and_entropies`` (1419), which scores the policy, the old policy and the
  reference (an adapter-disabled PEFT policy included), in TRL's chunks of ``batch_size`` rows.

The upstream seam this stands in for: a ``padding_free`` option on both trainers whose collator returns the
boundaries (``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``).

Under context parallelism (``packed_logprobs(context_parallel(DPOTrainer, size=2))``, or the two factories the
other way round) each pass packs the whole batch on every rank of the group as above, cuts the rank's slice of the
packed row with :func:`~compilepack.distributed.shard_batch` (a padding document to a multiple of the group size,
global boundaries), runs the slice through the context-parallel model and all-gathers the slices' per-token outputs
(a functional collective: its backward hands each rank the sum of the group's gradients of its slice) before they
are put in TRL's layout. Every rank then holds the whole batch's log-probs and computes the same loss; the sum of
the ranks' gradients is W times the one-process gradient, and DDP's mean over the W ranks gives it exactly (TRL's
DPO and GRPO losses are not rescaled by the process count, as HF Trainer's token-averaged loss is).

``args.padding_free=True`` (DPO's; GRPO has none in TRL 1.16) is taken as the request to pack: TRL's collator is
left padding (it falls back to padding anyway) and the passes pack, with the boundaries from the rows' lengths.

Refused, with a message naming the option: multimodal inputs (``pixel_values`` and the like), prompt-learning PEFT
(virtual tokens), a padded row with a gap inside its tokens, labels the packed row cannot score (at a padding token
or at a sequence's first token), trainers with neither seam, a batch a collator packed already (its boundaries
would have to be read off ``position_ids``), and under context parallelism ``balance=`` (it deals SFT documents),
MoE router logits (each rank's would cover its slice only) and ``torch_compile=True`` (not exact yet).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from ..batch.collators import to_device
from ..batch.keys import ATTENTION_MASK, IGNORE_INDEX, INPUT_IDS, LABELS, NUM_ITEMS_IN_BATCH, SHIFT_LABELS
from ..batch.layout import Boundaries
from ..batch.lengths import boundary_kwargs
from ..distributed import shard_batch
from ..distributed.collectives import gather_tokens
from ..errors import BoundaryError, CompilepackError, ContextParallelError
from ..patching import is_patched, patch

__all__ = ["PackedLogProbsMixin", "PackedModelCall", "RowSpans", "boundary_kwargs", "packed_logprobs"]

# The keys TRL's log-prob calls pass that a packed call takes as they are.
PASSED_THROUGH = ("use_cache", "output_router_logits")
# TRL's seams: a trainer class must have one of them (DPO: both).
DPO_SEAMS = ("_compute_loss", "compute_ref_log_probs")
GRPO_SEAM = "_get_per_token_logps_and_entropies"


def packed_logprobs(trainer_class: type) -> type:
    """``trainer_class`` (TRL's ``DPOTrainer``, ``GRPOTrainer`` or a subclass) whose log-prob passes run as packed
    rows through the compilepack-patched model (patched by the trainer if it is not yet), exact for every family.

    Example::

        from trl import DPOConfig, DPOTrainer
        from compilepack.integrations import packed_logprobs

        Trainer = packed_logprobs(DPOTrainer)                     # once, at module level
        trainer = Trainer(model=model, ref_model=ref, args=DPOConfig(...), train_dataset=pairs, ...)
        trainer.train()                                           # torch_compile=True: one graph

    See the module docstring for the passes, and what is refused.
    """
    if not scores_padded_batches(trainer_class):
        raise CompilepackError(
            f"packed_logprobs({trainer_class.__name__}): compilepack packs the log-prob passes of TRL's DPOTrainer "
            f"(its {' and '.join(DPO_SEAMS)}) and GRPOTrainer (its {GRPO_SEAM}); {trainer_class.__name__} has "
            "neither. For SFTTrainer use padding_free=True (it packs by itself).")
    return type(f"Packed{trainer_class.__name__}", (PackedLogProbsMixin, trainer_class), {
        "__module__": trainer_class.__module__,
        "__doc__": f"{trainer_class.__name__} whose log-prob passes run packed (compilepack.integrations."
                   "packed_logprobs).",
    })


def scores_padded_batches(trainer_class: type) -> bool:
    """Whether ``trainer_class`` is TRL's DPOTrainer or has GRPOTrainer's seam (what packed_logprobs packs)."""
    if hasattr(trainer_class, GRPO_SEAM):
        return True
    try:
        return issubclass(trainer_class, _dpo_trainer())
    except ImportError:  # no TRL: no DPOTrainer either
        return False


def _dpo_trainer() -> type:
    from trl.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer


class PackedLogProbsMixin:
    """The methods :func:`packed_logprobs` puts in front of a TRL trainer class."""

    # read by ContextParallelTrainerMixin: the batches stay padded, each pass shards its own packed row
    shards_inside_passes = True

    def __init__(self, *args, **kwargs):
        # patched before TRL adds its fused head (routed as it is added) and before a precomputation of the
        # reference log-probs; a model TRL loads itself (a path) is patched after
        for key in ("model", "ref_model"):
            if isinstance(kwargs.get(key), torch.nn.Module):
                _patched(kwargs[key])
        if args and isinstance(args[0], torch.nn.Module):
            _patched(args[0])
        args, kwargs = _padding_left_to_the_passes(args, kwargs)
        super().__init__(*args, **kwargs)
        _refuse_prompt_learning(self.model)
        for model in (self.model, getattr(self, "ref_model", None)):
            if model is not None:
                _patched(model)

    def _packed(self, model) -> PackedModelCall:
        """``model`` as TRL's passes call it, packed (and sharded over the trainer's context-parallel group)."""
        return PackedModelCall(model, context_parallel=getattr(self, "context_parallel_group", None),
                               pad_token_id=_pad_token_id(self))

    # ------------------------------------------------------------------------------------------ GRPO

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's own, with every model call packed (its chunks of ``batch_size`` rows, each one packed row)."""
        return super()._get_per_token_logps_and_entropies(
            self._packed(model), input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    # ------------------------------------------------------------------------------------------ DPO

    def compute_ref_log_probs(self, model, inputs):
        """TRL's own (adapters disabled for a PEFT policy without a reference), the call packed."""
        return super().compute_ref_log_probs(self._packed(model), inputs)

    def _compute_loss(self, model, inputs, *args, **kwargs):
        if not isinstance(self, _dpo_trainer()):  # GRPO's scores through _get_per_token_logps_and_entropies
            return super()._compute_loss(model, inputs, *args, **kwargs)
        if self.precompute_ref_logps:  # the reference's log-probs are in the batch (computed packed)
            return super()._compute_loss(self._packed(model), inputs, *args, **kwargs)
        reference = self.ref_model if self.ref_model is not None else self.model
        ref_chosen, ref_rejected = self.compute_ref_log_probs(reference, inputs)
        inputs = {**inputs, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
        with _reference_given(self):
            return super()._compute_loss(self._packed(model), inputs, *args, **kwargs)


# where DPOTrainer and GRPOTrainer take their training arguments positionally: (model, ref_model | reward_funcs, args)
ARGS_POSITION = 2


def _padding_left_to_the_passes(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The trainer's arguments with ``padding_free=True`` taken as the request to pack, which the passes do, exact
    for hybrids: TRL's collator is kept padding (TRL 1.16's DPO falls back to padding anyway, warning that it does
    not pack), since a collator that packed would leave only ``position_ids`` to find the sequences by, which
    compilepack never reads boundaries from. The caller's configuration object is left as given (a copy)."""
    config = kwargs.get("args", args[ARGS_POSITION] if len(args) > ARGS_POSITION else None)
    if not getattr(config, "padding_free", False):
        return args, kwargs
    config = copy.copy(config)
    config.padding_free = False
    if "args" in kwargs:
        return args, {**kwargs, "args": config}
    return (*args[:ARGS_POSITION], config, *args[ARGS_POSITION + 1:]), kwargs


def _pad_token_id(trainer) -> int:
    """The token of the padding document that rounds a sharded packed row up to the group size (its outputs are
    dropped: any token of the vocabulary does)."""
    token = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None)
    return token if isinstance(token, int) else 0


@contextlib.contextmanager
def _reference_given(trainer):
    """DPO's loss reads the step's reference log-probs from the batch (as with ``precompute_ref_log_probs``)."""
    trainer.precompute_ref_logps = True
    try:
        yield
    finally:
        trainer.precompute_ref_logps = False


def _patched(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` patched (once): the model a compiled trainer wrapped is patched inside its wrapper, before the
    first call compiles it."""
    inner = _unwrapped(model)
    if not is_patched(inner):
        patch(inner)  # which also turns off transformers' re-kernelizing on train() / eval()
    return model


def _unwrapped(model):
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _refuse_prompt_learning(model) -> None:
    for config in (getattr(model, "peft_config", None) or {}).values():
        if getattr(config, "is_prompt_learning", False):
            raise CompilepackError(
                f"packed_logprobs: PEFT {type(config).__name__} prepends virtual tokens to every row, which a packed "
                "row would give to its first sequence only; train a LoRA-style adapter, or use the trainer unpacked.")


# ---------------------------------------------------------------------------------------------- the packed call


@dataclasses.dataclass(frozen=True)
class RowSpans:
    """Where the tokens of each row of a padded batch are (host): row ``b`` holds ``lengths[b]`` tokens from column
    ``starts[b]`` on, the rest of its ``width`` columns padding (left, right or both)."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    width: int

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> RowSpans:
        """Read off a ``[B, W]`` ``attention_mask``; refuses a row with no tokens or a gap inside its tokens."""
        if attention_mask.dim() != 2:
            raise BoundaryError(f"{ATTENTION_MASK}: a packed log-prob pass needs the padded batch's [B, W] mask, got "
                                f"shape {tuple(attention_mask.shape)}.")
        mask = attention_mask.detach().to("cpu").bool()
        lengths = mask.sum(1)
        starts = mask.int().argmax(1)
        columns = torch.arange(mask.shape[1])
        run = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
        broken = ((run != mask).any(1) | (lengths == 0)).nonzero().flatten().tolist()
        if broken:
            raise BoundaryError(
                f"{ATTENTION_MASK}: rows {broken[:8]} are not one run of tokens (no token, or padding inside the "
                "tokens); a packed pass takes each row's tokens as one sequence, padded left, right or both.")
        return cls(tuple(starts.tolist()), tuple(lengths.tolist()), mask.shape[1])

    @property
    def offsets(self) -> list[int]:
        """Where each row's sequence starts in the packed row."""
        offsets = [0]
        for n in self.lengths[:-1]:
            offsets.append(offsets[-1] + n)
        return offsets

    def token_index(self) -> torch.Tensor:
        """``[N]`` index of every packed token in the flattened ``[B * W]`` batch."""
        return torch.cat([torch.arange(s, s + n) + b * self.width
                          for b, (s, n) in enumerate(zip(self.starts, self.lengths))])

    def scores_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, W - 1]`` index into the packed scores of each padded score (column ``t`` scores token ``t + 1``),
        and where one exists (a row's columns ``starts .. starts + lengths - 2``)."""
        columns = torch.arange(self.width - 1)
        starts, lengths = torch.tensor(self.starts)[:, None], torch.tensor(self.lengths)[:, None]
        inside = (columns >= starts) & (columns < starts + lengths - 1)
        index = (torch.tensor(self.offsets)[:, None] + columns - starts).clamp(min=0, max=sum(self.lengths) - 1)
        return index, inside


# TRL's per-token outputs of the fused head, [B, W - 1] each
PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class PackedModelCall:
    """Stands in for a model in TRL's log-prob calls: ``call(input_ids=[B, W], attention_mask=[B, W],
    labels=[B, W], fused_lm_head=True)`` runs the batch's rows as one packed row through ``model`` and returns TRL's
    ``FusedCausalLMOutput`` in the padded ``[B, W - 1]`` layout (see the module docstring).

    ``context_parallel``: the :class:`~compilepack.distributed.ContextParallel` group ``model`` was patched with
    (every rank of the group calls with the same batch): the rank runs its slice of the packed row, and the slices'
    per-token outputs are gathered; ``pad_token_id``: the token of the padding document that rounds the row up to
    a multiple of the group size."""

    def __init__(self, model, context_parallel=None, pad_token_id: int = 0):
        self.model = model
        self.context_parallel = context_parallel
        self.pad_token_id = pad_token_id

    def __call__(self, *, input_ids, labels, attention_mask=None, fused_lm_head=False, **rest):
        if attention_mask is None:
            raise CompilepackError(
                f"packed_logprobs: a log-prob call without an attention_mask ({sorted(rest)} besides input_ids and "
                "labels): a batch a collator packed already is not packed again (its sequences could only be found "
                "from position_ids, which compilepack never reads boundaries from). Let the trainer's collator pad "
                "(packed_logprobs keeps it padding for padding_free=True) and packed_logprobs pack.")
        unknown = sorted(set(rest) - set(PASSED_THROUGH))
        if unknown or not fused_lm_head:
            raise CompilepackError(
                f"packed_logprobs: a log-prob call passed {unknown or ['fused_lm_head=False']}; a packed pass takes "
                f"input_ids, attention_mask, labels, fused_lm_head=True and {list(PASSED_THROUGH)} only (multimodal "
                "inputs are not packed yet: train such models with the trainer unpacked).")
        if not is_patched(_unwrapped(self.model)):
            raise CompilepackError(
                "packed_logprobs: the model of a packed log-prob pass is not compilepack-patched, so its mixers "
                "would mix the packed sequences; compilepack.patch(model) it (the trainer does for its own).")
        spans = RowSpans.of(attention_mask)
        packed = _packed_inputs(input_ids, labels, spans)
        rest["use_cache"] = False
        if self.context_parallel is None:
            outputs = self.model(**to_device(packed, input_ids.device), fused_lm_head=True, **rest)
        else:
            outputs = self._run_sharded(packed, input_ids.device, rest)
        return _in_padded_layout(outputs, labels, spans)

    def _run_sharded(self, packed: dict, device: torch.device, rest: dict):
        """The rank's slice of the packed row through the context-parallel model, and the group's per-token
        outputs gathered back into the whole row (``[1, N]``; the padding document's dropped)."""
        cp = self.context_parallel
        if rest.get("output_router_logits"):
            raise ContextParallelError(
                "packed_logprobs under context parallelism: output_router_logits=True (the MoE aux loss) would give "
                "each rank the load-balancing loss of its slice only; set router_aux_loss_coef=0 (or "
                "output_router_logits=False) in the model config, or train without context parallelism.")
        shard = shard_batch(_with_unshifted_labels(packed), cp, pad_token_id=self.pad_token_id)
        for key in (LABELS, NUM_ITEMS_IN_BATCH):  # the fused head scores shift_labels; TRL's losses count
            shard.pop(key)
        outputs = self.model(**to_device(shard, device), fused_lm_head=True, **rest)
        tokens = packed[INPUT_IDS].shape[1]
        gathered = {name: _gathered(getattr(outputs, name), cp)[:, :tokens] for name in PER_TOKEN
                    if getattr(outputs, name, None) is not None}
        return dataclasses.replace(outputs, **gathered)


def _packed_inputs(input_ids: torch.Tensor, labels: torch.Tensor, spans: RowSpans) -> dict:
    """The packed row: tokens, boundaries (positions restarting per sequence) and each token's target, the next
    token's label (``-100`` at a sequence's last token)."""
    _refuse_unscorable_labels(labels, spans)
    index = spans.token_index()
    tokens = input_ids.detach().to("cpu").reshape(-1)[index]
    next_labels = torch.full_like(labels, IGNORE_INDEX, device="cpu")
    next_labels[:, :-1] = labels.detach().to("cpu")[:, 1:]
    targets = next_labels.reshape(-1)[index]
    ends = torch.tensor(spans.offsets) + torch.tensor(spans.lengths) - 1
    targets[ends] = IGNORE_INDEX
    boundaries = Boundaries.from_lengths(spans.lengths).as_kwargs()
    return {INPUT_IDS: tokens[None], SHIFT_LABELS: targets[None], **boundaries}


def _with_unshifted_labels(packed: dict) -> dict:
    """The packed row for :func:`~compilepack.distributed.shard_batch`, which shifts ``labels`` over the whole row
    before slicing: ``labels`` whose shift is the row's targets (a sequence's first token is -100 either way)."""
    targets = packed[SHIFT_LABELS]
    labels = torch.nn.functional.pad(targets[:, :-1], (1, 0), value=IGNORE_INDEX)
    return {**{key: value for key, value in packed.items() if key != SHIFT_LABELS}, LABELS: labels}


def _gathered(per_token: torch.Tensor, cp) -> torch.Tensor:
    """``[1, N / W]`` slices of the group -> ``[1, N]``, differentiable (gloo gathers no bools: as bytes)."""
    if per_token.dtype == torch.bool:
        return gather_tokens(per_token.to(torch.uint8), cp).bool()
    return gather_tokens(per_token, cp)


def _refuse_unscorable_labels(labels: torch.Tensor, spans: RowSpans) -> None:
    """A label at a padding column, or at a sequence's first token, has no place in the packed row (the padded
    pass would score it from a padding token): refused, never dropped."""
    scorable = torch.zeros(labels.shape, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(spans.starts, spans.lengths)):
        scorable[b, s + 1:s + n] = True
    stray = ((labels.detach().to("cpu") != IGNORE_INDEX) & ~scorable).nonzero().tolist()
    if stray:
        raise BoundaryError(
            f"{LABELS}: {len(stray)} label(s) outside what a packed pass can score, first at (row, column) "
            f"{stray[0]}: labels must be -100 at padding and at each sequence's first token (no token before it).")


def _in_padded_layout(outputs, labels: torch.Tensor, spans: RowSpans):
    """TRL's ``FusedCausalLMOutput`` with the packed ``[1, N]`` per-token outputs gathered into ``[B, W - 1]``."""
    index, inside = (t.to(labels.device) for t in spans.scores_index())
    padded = {}
    for name in PER_TOKEN:
        value = getattr(outputs, name)
        padded[name] = None if value is None else value.reshape(-1)[index].masked_fill(~inside, 0)
    return dataclasses.replace(outputs, label_mask=labels[:, 1:] != IGNORE_INDEX, **padded)
