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

Refused, with a message naming the option: multimodal inputs (``pixel_values`` and the like), prompt-learning PEFT
(virtual tokens), a padded row with a gap inside its tokens, labels the packed row cannot score (at a padding token
or at a sequence's first token), trainers with neither seam, and :func:`~compilepack.integrations.context_parallel`
on top (its shards are cut from the collator's batch, which is padded here).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..batch.collators import to_device
from ..batch.keys import ATTENTION_MASK, IGNORE_INDEX, INPUT_IDS, LABELS, SHIFT_LABELS
from ..batch.layout import Boundaries
from ..batch.lengths import boundary_kwargs
from ..errors import BoundaryError, CompilepackError
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
    if not (issubclass(trainer_class, _dpo_trainer()) or hasattr(trainer_class, GRPO_SEAM)):
        raise CompilepackError(
            f"packed_logprobs({trainer_class.__name__}): compilepack packs the log-prob passes of TRL's DPOTrainer "
            f"(its {' and '.join(DPO_SEAMS)}) and GRPOTrainer (its {GRPO_SEAM}); {trainer_class.__name__} has "
            "neither. For SFTTrainer use padding_free=True (it packs by itself).")
    if any(klass.__name__ == "ContextParallelTrainerMixin" for klass in trainer_class.__mro__):
        raise CompilepackError(
            f"packed_logprobs({trainer_class.__name__}): context parallelism cuts each rank's shard from the "
            "collator's batch, which is padded for DPO and GRPO: the packed log-prob passes do not run under "
            "compilepack.integrations.context_parallel yet. Train without it, or pack with SFTTrainer.")
    return type(f"Packed{trainer_class.__name__}", (PackedLogProbsMixin, trainer_class), {
        "__module__": trainer_class.__module__,
        "__doc__": f"{trainer_class.__name__} whose log-prob passes run packed (compilepack.integrations."
                   "packed_logprobs).",
    })


def _dpo_trainer() -> type:
    from trl.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer


class PackedLogProbsMixin:
    """The methods :func:`packed_logprobs` puts in front of a TRL trainer class."""

    def __init__(self, *args, **kwargs):
        # patched before TRL adds its fused head (routed as it is added) and before a precomputation of the
        # reference log-probs; a model TRL loads itself (a path) is patched after
        for key in ("model", "ref_model"):
            if isinstance(kwargs.get(key), torch.nn.Module):
                _patched(kwargs[key])
        if args and isinstance(args[0], torch.nn.Module):
            _patched(args[0])
        super().__init__(*args, **kwargs)
        _refuse_prompt_learning(self.model)
        for model in (self.model, getattr(self, "ref_model", None)):
            if model is not None:
                _patched(model)

    # ------------------------------------------------------------------------------------------ GRPO

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's own, with every model call packed (its chunks of ``batch_size`` rows, each one packed row)."""
        return super()._get_per_token_logps_and_entropies(
            PackedModelCall(model), input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    # ------------------------------------------------------------------------------------------ DPO

    def compute_ref_log_probs(self, model, inputs):
        """TRL's own (adapters disabled for a PEFT policy without a reference), the call packed."""
        return super().compute_ref_log_probs(PackedModelCall(model), inputs)

    def _compute_loss(self, model, inputs, *args, **kwargs):
        if not isinstance(self, _dpo_trainer()):  # GRPO's scores through _get_per_token_logps_and_entropies
            return super()._compute_loss(model, inputs, *args, **kwargs)
        if self.precompute_ref_logps:  # the reference's log-probs are in the batch (computed packed)
            return super()._compute_loss(PackedModelCall(model), inputs, *args, **kwargs)
        reference = self.ref_model if self.ref_model is not None else self.model
        ref_chosen, ref_rejected = self.compute_ref_log_probs(reference, inputs)
        inputs = {**inputs, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
        with _reference_given(self):
            return super()._compute_loss(PackedModelCall(model), inputs, *args, **kwargs)


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
    ``FusedCausalLMOutput`` in the padded ``[B, W - 1]`` layout (see the module docstring)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *, input_ids, labels, attention_mask=None, fused_lm_head=False, **rest):
        if attention_mask is None:
            raise CompilepackError(
                f"packed_logprobs: a log-prob call without an attention_mask ({sorted(rest)} besides input_ids and "
                "labels): a batch the trainer's collator packed already (padding_free) is not packed again; turn "
                "the trainer's padding_free off and let packed_logprobs pack.")
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
        outputs = self.model(**to_device(packed, input_ids.device), fused_lm_head=True, **rest)
        return _in_padded_layout(outputs, labels, spans)


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
