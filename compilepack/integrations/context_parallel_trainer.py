"""Context parallelism from HF ``Trainer`` and TRL's ``SFTTrainer``: packing and long rows split across ranks.

TRL refuses packing with accelerate's context parallelism (``cp_size > 1``: it would attend across documents), and
accelerate's own context parallelism is SDPA ring attention, which the linear-attention, Mamba and conv layers do not
have. compilepack's context parallelism runs every mixer of a patched model on a rank's slice of each packed row
(``compilepack.patch(model, context_parallel=...)``); :func:`context_parallel` turns it on in a trainer class::

    from trl import SFTConfig, SFTTrainer
    from compilepack.integrations import context_parallel

    Trainer = context_parallel(SFTTrainer, size=2)           # or HF Trainer; once, at module level
    trainer = Trainer(model=model, args=SFTConfig(..., padding_free=True), train_dataset=dataset, ...)
    trainer.train()                                           # torchrun --nproc_per_node 4 train.py

``mode`` chooses how a group's mixers see the whole row (docs/context-parallel.md compares them)::

    context_parallel(SFTTrainer, size=4)                                  # Ulysses: heads split 4 ways
    context_parallel(SFTTrainer, size=4, mode="sequence")                 # tokens: past the head counts
    context_parallel(SFTTrainer, size=8, mode="hybrid", ulysses_size=2)   # Ulysses in pairs, sequence across 4
    context_parallel(SFTTrainer, size=8, mode="sequence", state_pass="log")   # the states' pass, log-depth

Launched on ``W`` processes (``torchrun`` or ``accelerate launch``), the ranks form a ``dp x cp`` mesh (``cp =
size``, ``dp = W / size``, ``mesh_dim_names=("dp", "cp")``; the hybrid mode splits ``cp`` into ``("sequence",
"ulysses")``, ``ulysses_size`` inner: ``("dp", "sequence", "ulysses")``). What the subclass changes, and why:

- the model is patched with the group's :class:`~compilepack.distributed.ContextParallel` (Ulysses over
  ``mesh["cp"]``, :meth:`~compilepack.distributed.ContextParallel.sequence_parallel` over it, or
  :meth:`~compilepack.distributed.ContextParallel.hybrid` over ``mesh["sequence", "ulysses"]``), before the trainer
  compiles or wraps it; a model given ``patch(model, lm_head="chunked")`` keeps its chunked LM head;
- the data loader is sharded over the ``dp`` ranks only: the ranks of a context-parallel group draw the same global
  batch (and, with ``balance=``, a :class:`~compilepack.distributed.BalancedBatchSampler` deals documents to the
  ``dp`` ranks by cost);
- every batch is cut into this rank's slice with :func:`~compilepack.distributed.shard_batch` (global boundaries,
  ``shift_labels`` shifted before slicing, which TRL's fused LM head and the HF loss read), in the trainer's own hook
  for context parallelism (``_prepare_context_parallel_inputs``), after it counted the global batch's targets;
- ``num_items_in_batch`` counts the global batches' targets once per data-parallel replica (summed over the ``dp``
  ranks only), and the trainer scales each rank's loss by the process count: with DDP or FSDP2 over all ``W``
  ranks averaging gradients, the update, the logged loss and the evaluation loss are one process's
  (``get_cp_size()`` returns ``size`` for the trainer's other bookkeeping; ``compute_metrics`` gets each rank's
  shard: logits and labels of its tokens, the labels already shifted);
- ``torch_compile=True`` compiles the patched model as the compile recipe says (``fullgraph=True, dynamic=True``),
  inside DDP / FSDP, one graph per rank.

TRL's ``DPOTrainer`` and ``GRPOTrainer`` collate padded batches, so they run context-parallel only with their
log-prob passes packed: ``packed_logprobs(context_parallel(DPOTrainer, size=2))`` (either order). The batches then
reach the model unsharded, each pass packs and shards its own row (:mod:`compilepack.integrations.rl_trainers`), and
the reference model is patched with the same group; ``context_parallel(DPOTrainer)`` alone is refused, naming that.

accelerate's and transformers' own ``cp_size`` / ``sp_size`` (``ParallelismConfig``, DeepSpeed Ulysses) are refused:
they would split the tokens but not the boundaries, or run a second context parallelism beside this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from ..batch.keys import INPUT_IDS, LABELS, NUM_ITEMS_IN_BATCH, SHIFT_LABELS
from ..distributed import BalancedBatchSampler, ContextParallel, shard_batch
from ..distributed.group import HYBRID, SEQUENCE, ULYSSES
from ..distributed.scan import SCHEDULES
from ..errors import ContextParallelError
from ..patching import ATTENTION, family_of, patch
from ..batch.keys import IGNORE_INDEX
from ..batch.collators import to_device

__all__ = ["Balance", "ContextParallelTrainerMixin", "attention_length_of", "context_parallel"]


@dataclasses.dataclass(frozen=True)
class Balance:
    """Documents dealt to the data-parallel ranks by cost (:class:`~compilepack.distributed.BalancedBatchSampler`):
    ``tokens_per_rank`` per step and rank; ``attention_length`` None derives it from the model (``12 x hidden /``
    the fraction of layers that attend)."""

    tokens_per_rank: int
    attention_length: float | None = None


MODES = (ULYSSES, SEQUENCE, HYBRID)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a context-parallel group of ``size`` ranks splits its mixers' work: ``mode`` (``"ulysses"``,
    ``"sequence"`` or ``"hybrid"``), the hybrid's ``ulysses_size`` (the ranks splitting heads; the tokens are split
    ``size / ulysses_size`` ways) and the linear mixers' ``state_pass`` (sequence and hybrid)."""

    size: int
    mode: str = ULYSSES
    ulysses_size: int | None = None
    state_pass: str | None = None

    def __post_init__(self):
        _check_layout(self)

    def group(self, mesh) -> ContextParallel:
        """The :class:`ContextParallel` of this rank on the trainer's mesh (:func:`_mesh`)."""
        state_pass = self.state_pass or "auto"
        if self.mode == SEQUENCE:
            return ContextParallel.sequence_parallel(mesh["cp"], state_pass=state_pass)
        if self.mode == HYBRID:
            return ContextParallel.hybrid(mesh["sequence", "ulysses"], state_pass=state_pass)
        return ContextParallel.of(mesh["cp"])


def _check_layout(layout: Layout) -> None:
    """Refuse a size, mode, Ulysses size or state pass that names no layout, saying which option and the fix."""
    size, mode, ulysses, state_pass = layout.size, layout.mode, layout.ulysses_size, layout.state_pass
    where = f"context_parallel(size={size!r}, mode={mode!r}"
    if not isinstance(size, int) or size < 1:
        raise ContextParallelError(f"context_parallel(size={size!r}): the size must be an int >= 1.")
    if mode not in MODES:
        raise ContextParallelError(f"{where}): mode must be one of {MODES}.")
    if mode != HYBRID and ulysses is not None:
        raise ContextParallelError(
            f"{where}, ulysses_size={ulysses!r}): ulysses_size is the hybrid mode's Ulysses group; pass "
            f"mode='hybrid' with it, or leave it out.")
    if mode == HYBRID and not (isinstance(ulysses, int) and 1 < ulysses < size and size % ulysses == 0):
        raise ContextParallelError(
            f"{where}, ulysses_size={ulysses!r}): the hybrid mode needs ulysses_size, an int between 2 and size / 2 "
            f"that divides the size (the heads split ulysses_size ways, the tokens size / ulysses_size ways); for "
            f"heads alone use mode='ulysses', for tokens alone mode='sequence'.")
    if state_pass is not None and mode == ULYSSES:
        raise ContextParallelError(
            f"{where}, state_pass={state_pass!r}): Ulysses passes no state (each rank runs whole rows of its heads); "
            f"state_pass applies to mode='sequence' or 'hybrid'.")
    if state_pass is not None and state_pass not in SCHEDULES:
        raise ContextParallelError(f"{where}, state_pass={state_pass!r}): state_pass must be one of {SCHEDULES}.")


def context_parallel(trainer_class: type, size: int, *, mode: str = ULYSSES, ulysses_size: int | None = None,
                     state_pass: str | None = None, balance: int | Balance | None = None) -> type:
    """``trainer_class`` (HF ``Trainer``, TRL ``SFTTrainer`` or a subclass) running compilepack's context
    parallelism over groups of ``size`` ranks.

    Args:
        mode: ``"ulysses"`` (heads split ``size`` ways: ``size`` at most the head counts), ``"sequence"`` (every
            mixer on the rank's slice of tokens: any ``size``) or ``"hybrid"`` (Ulysses over ``ulysses_size`` ranks,
            sequence across ``size / ulysses_size`` such groups).
        ulysses_size: the hybrid mode's Ulysses group size (hybrid only).
        state_pass: how the linear mixers' states cross the ranks, ``"auto"`` (the default), ``"sequential"`` or
            ``"log"`` (sequence and hybrid only; :mod:`compilepack.distributed.scan`).
        balance: a token budget per rank and step (or a :class:`Balance`) to deal documents across the
            data-parallel ranks by cost.

    See the module docstring."""
    layout = Layout(size, mode, ulysses_size, state_pass)
    balance = Balance(balance) if isinstance(balance, int) else balance
    name = f"ContextParallel{trainer_class.__name__}"
    return type(name, (ContextParallelTrainerMixin, trainer_class),
                {"context_parallel_size": size, "context_parallel_layout": layout,
                 "context_parallel_balance": balance,
                 "__module__": trainer_class.__module__, "__doc__": f"{trainer_class.__name__} with compilepack's "
                 f"context parallelism ({mode}) over groups of {size} ranks (compilepack.integrations."
                 "context_parallel)."})


class ContextParallelTrainerMixin:
    """The methods :func:`context_parallel` puts in front of a trainer class (``class MyTrainer(
    ContextParallelTrainerMixin, SFTTrainer): context_parallel_size = 2`` does the same; a mode other than Ulysses:
    ``context_parallel_layout = Layout(4, "sequence")``)."""

    context_parallel_size: int = 1
    context_parallel_layout: Layout | None = None  # None: Ulysses over context_parallel_size ranks
    context_parallel_balance: Balance | None = None

    def __init__(self, *args, **kwargs):
        _refuse_padded_log_prob_trainers(type(self))
        _refuse_other_sequence_parallelism(kwargs.get("args"), "the training arguments' parallelism_config")
        super().__init__(*args, **kwargs)
        _refuse_other_sequence_parallelism(self.accelerator, "accelerate's configuration")
        _refuse_compiled_packed_passes(self)
        layout = self.context_parallel_layout or Layout(self.context_parallel_size)
        self.context_parallel_mesh = _mesh(layout, self.args.device)
        # the one ContextParallel object of this rank: the patched model and every shard hold it (checked by identity)
        self.context_parallel_group = layout.group(self.context_parallel_mesh)
        patch(self.model, context_parallel=self.context_parallel_group)
        reference = getattr(self, "ref_model", None)  # DPO's and GRPO's: its passes are sharded alike
        if _shards_inside_passes(self) and isinstance(reference, torch.nn.Module):
            patch(getattr(reference, "_orig_mod", reference), context_parallel=self.context_parallel_group)
        if _generates(self):
            self._seed_the_group_alike()
        if self.args.torch_compile:
            self._compile_the_patched_model()

    def _compile_the_patched_model(self) -> None:
        """``torch_compile=True``: the patched model is compiled as the docs' recipe says (``fullgraph=True,
        dynamic=True``: the shards' lengths and document counts change every batch), with the arguments' backend
        and mode, before DDP / FSDP wrap it. accelerate would compile the wrapper instead, whose DDP forward breaks
        the graph (``_inside_ddp_forward`` is not traced)."""
        from accelerate.utils import DynamoBackend

        options = {"backend": self.args.torch_compile_backend or "inductor"}
        if self.args.torch_compile_mode is not None:
            options["mode"] = self.args.torch_compile_mode
        self.model = self.model_wrapped = torch.compile(self.model, fullgraph=True, dynamic=True, **options)
        self.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO

    def _seed_the_group_alike(self) -> None:
        """GRPO seeds every process apart so that they sample different completions (``set_seed(seed,
        device_specific=True)``: seed + process index). The ranks of a context-parallel group score one batch, so
        they must sample the same completions: each rank is seeded with its data-parallel index instead, as that
        process of a run without context parallelism would be."""
        from accelerate.utils import set_seed

        set_seed(self.args.seed + self._dp[1])

    # ------------------------------------------------------------------------------------------ sizes

    def get_cp_size(self) -> int:
        return self.context_parallel_size

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The targets of the step's global batches (``num_items_in_batch``), counted once per data-parallel
        replica: the ranks of a group hold the same batches, so the count is summed over the ``dp`` ranks only
        (with ``average_tokens_across_devices``), whatever the installed trainer's own count divides by."""
        counted = batch_samples and LABELS in batch_samples[0] and (
            self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
        if not counted:
            return None
        count = sum((batch[SHIFT_LABELS] if SHIFT_LABELS in batch else batch[LABELS][..., 1:]).ne(IGNORE_INDEX).sum()
                    for batch in batch_samples).to(device)
        if self.args.average_tokens_across_devices:
            dist.all_reduce(count, group=self.context_parallel_mesh["dp"].get_group())
        return count

    @property
    def _dp(self) -> tuple[int, int]:
        """(data-parallel size, this rank's data-parallel index)."""
        mesh = self.context_parallel_mesh
        return mesh["dp"].size(), mesh["dp"].get_local_rank()

    # ------------------------------------------------------------------------------------------ data

    def _balanced_sampler(self) -> BalancedBatchSampler:
        strategy = getattr(self.args, "train_sampling_strategy", "random")
        if strategy not in ("random", "sequential"):
            raise ContextParallelError(
                f"context_parallel(..., balance=...) deals documents by cost and replaces the trainer's sampler: "
                f"train_sampling_strategy={strategy!r} would be ignored; leave it 'random' (or leave balance out).")
        dataset = self.train_dataset
        dp_size, dp_rank = self._dp
        balance = self.context_parallel_balance
        attention_length = balance.attention_length or attention_length_of(self.accelerator.unwrap_model(self.model))
        return BalancedBatchSampler(
            _lengths(dataset), num_replicas=dp_size, rank=dp_rank, tokens_per_rank=balance.tokens_per_rank,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            attention_length=attention_length, drop_last=self.args.dataloader_drop_last,
        )

    def _get_train_sampler(self, *args, **kwargs):
        """GRPO's sampler, its generation batches sized for the data-parallel ranks (see :func:`_per_replica`)."""
        sampler = super()._get_train_sampler(*args, **kwargs)
        repeats = hasattr(sampler, "mini_repeat_count")  # TRL's RepeatSampler: GRPO's generation batches
        return _per_replica(sampler, self) if repeats else sampler

    def get_train_dataloader(self):
        if self.context_parallel_balance is None:
            return _shard_over_data_parallel_ranks(super().get_train_dataloader(), *self._dp)
        return _balanced_loader(self, self._balanced_sampler())

    def get_eval_dataloader(self, eval_dataset=None):
        return _shard_over_data_parallel_ranks(super().get_eval_dataloader(eval_dataset), *self._dp)

    # ------------------------------------------------------------------------------------------ steps

    def training_step(self, model, inputs, *args, **kwargs):
        refuse_unsynchronised(model, self.args.world_size)
        return super().training_step(model, inputs, *args, **kwargs)

    def _prepare_context_parallel_inputs(self, model, inputs):
        """The trainer's own hook for context parallelism, called on a global batch after it counted the batch's
        targets (``num_items_in_batch``) and before the forward, in training and evaluation alike: here it cuts
        this rank's slice, on the host (the boundaries are host data), and moves the slice's tokens to the device,
        the boundaries staying on the host."""
        if _shards_inside_passes(self):
            return contextlib.nullcontext, inputs
        host = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
        shard = shard_batch(host, self.context_parallel_group, pad_token_id=_pad_token_id(self))
        shard.pop(NUM_ITEMS_IN_BATCH, None)  # the trainer passes its own count, over every rank's batch
        return contextlib.nullcontext, to_device(shard, self.args.device)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """HF Trainer's evaluation step for every trainer class (TRL's own skips the context-parallel hook): the
        global batch's targets counted over every rank, this rank's slice, the loss with that count (as in
        training, so the evaluation loop's mean over the ranks is one process's loss)."""
        if _shards_inside_passes(self):  # the trainer's own evaluation, its passes sharded
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        if inputs.get(LABELS) is None:
            raise ContextParallelError(
                "evaluation under compilepack's context parallelism computes the loss: the evaluation batches need "
                "'labels'.")
        num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        _, shard = self._prepare_context_parallel_inputs(model, inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            if prediction_loss_only:
                loss = self.compute_loss(model, shard, num_items_in_batch=num_items_in_batch)
                return loss.detach().mean(), None, None
            loss, outputs = self.compute_loss(model, shard, return_outputs=True, num_items_in_batch=num_items_in_batch)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
        return loss.detach().mean(), logits.detach(), shard[LABELS]


def _mesh(layout: Layout, device: torch.device):
    """The ``(dp, cp)`` device mesh of all ranks (rank = dp index x cp + cp index, as accelerate lays out its own);
    in the hybrid mode ``(dp, sequence, ulysses)`` (the whole group: ``trainer.context_parallel_group.group``)."""
    from torch.distributed.device_mesh import init_device_mesh

    size = layout.size
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized() or world % size:
        raise ContextParallelError(
            f"context parallelism over groups of {size} ranks needs a distributed launch whose world size divides "
            f"by {size} (got {world if dist.is_initialized() else 'no process group'}): launch with torchrun "
            f"--nproc_per_node {size} (or a multiple) or accelerate launch --num_processes {size}.")
    if layout.mode != HYBRID:
        return init_device_mesh(device.type, (world // size, size), mesh_dim_names=("dp", "cp"))
    ulysses = layout.ulysses_size
    return init_device_mesh(device.type, (world // size, size // ulysses, ulysses),
                            mesh_dim_names=("dp", "sequence", "ulysses"))


def _generates(trainer) -> bool:
    """GRPO-style trainers, which sample groups of completions (TRL's ``num_generations``)."""
    return hasattr(trainer, "num_generations")


def _shards_inside_passes(trainer) -> bool:
    """packed_logprobs' mixin says so (in either order of the two factories): the batches stay as collated, each
    log-prob pass shards its own packed row."""
    return getattr(trainer, "shards_inside_passes", False)


def _refuse_padded_log_prob_trainers(trainer_class: type) -> None:
    """TRL's DPO and GRPO trainers collate padded batches, which shard_batch cannot cut: refused unless their
    log-prob passes are packed (and shard themselves)."""
    if _shards_inside_passes(trainer_class):
        if trainer_class.context_parallel_balance is not None:
            raise ContextParallelError(
                f"{trainer_class.__name__}: context_parallel(..., balance=...) deals SFT documents (their input_ids) "
                "to the data-parallel ranks by cost; DPO's pairs and GRPO's prompt groups are drawn by the trainer's "
                "own sampler. Leave balance out.")
        return
    from .rl_trainers import scores_padded_batches

    if scores_padded_batches(trainer_class):
        # the class given to context_parallel(), as the user named it
        given = trainer_class.__bases__[-1] if ContextParallelTrainerMixin in trainer_class.__bases__ else trainer_class
        raise ContextParallelError(
            f"context_parallel({given.__name__}): TRL's DPO and GRPO trainers collate padded batches, which context "
            "parallelism cannot split; pack their log-prob passes as well: "
            f"packed_logprobs(context_parallel({given.__name__}, size=...)) (compilepack.integrations).")


def _refuse_compiled_packed_passes(trainer) -> None:
    """Compiled, the packed DPO / GRPO passes under context parallelism are not exact yet: measured (Llama, 2 steps,
    aot_eager), a LoRA policy's adapter-disabled reference pass returned the policy's log-probs (DPO's loss stuck at
    log 2), and the policy compiled 4 graphs. Refused rather than silently wrong."""
    if _shards_inside_passes(trainer) and trainer.args.torch_compile:
        raise ContextParallelError(
            f"{type(trainer).__name__}: torch_compile=True with packed DPO / GRPO passes under context parallelism is "
            "not supported yet (measured: a LoRA policy's adapter-disabled reference pass, compiled, scored as the "
            "policy). Train these eager under context parallelism (torch_compile=False), or compile them without "
            "context parallelism (packed_logprobs(DPOTrainer) alone compiles to one graph).")


def refuse_unsynchronised(model: torch.nn.Module, world_size: int) -> None:
    """Each rank's gradient covers its slice of the rows only (and the RL passes' gather hands it the group's sum):
    the update is right only once DDP, FSDP or DeepSpeed averages the gradients over every rank. A trainer whose
    model reaches the training step unwrapped (seen: a PEFT policy under HF Trainer, ``evaluate()`` called before
    ``train()``, which keeps the evaluation's unwrapped model and skips accelerate's DDP) would step each rank on
    its own gradient, silently: refused instead."""
    if world_size <= 1 or _synchronises_gradients(model):
        return
    raise ContextParallelError(
        f"the model reached the training step as a bare {type(model).__name__}, not wrapped by DDP, FSDP or "
        f"DeepSpeed, with {world_size} processes: under context parallelism each rank's gradient covers its slice "
        "only, so the ranks must average them. HF Trainer skips accelerate's wrapping when evaluate() ran before "
        "train() on some models (a PEFT policy): call train() first, or pass the model already wrapped.")


def _synchronises_gradients(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wrappers = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    return isinstance(model, wrappers) or type(model).__name__ == "DeepSpeedEngine"


def _refuse_other_sequence_parallelism(holder, where: str) -> None:
    """accelerate's / transformers' ``ParallelismConfig`` with ``cp_size`` or ``sp_size`` above 1: refused, never
    run beside compilepack's (they split tokens, not boundaries, and only know attention)."""
    config = getattr(holder, "parallelism_config", None)
    if config is None:
        return
    for name in ("cp_size", "sp_size"):
        value = getattr(config, name, None) or 1
        if value > 1:
            raise ContextParallelError(
                f"{where} sets {name}={value}: accelerate's "
                f"{'ring attention' if name == 'cp_size' else 'DeepSpeed Ulysses'} "
                "splits the tokens of every row but not the packed documents' boundaries, and runs on attention only "
                "(linear-attention, Mamba and conv layers would see each shard as whole rows). compilepack's context "
                "parallelism replaces it: remove the parallelism_config's cp_size / sp_size and use "
                "compilepack.integrations.context_parallel(TrainerClass, size=...) (docs/context-parallel.md)."
            )


def _per_replica(sampler, trainer):
    """GRPO's ``RepeatSampler`` with its generation batch sized for the data-parallel ranks.

    TRL sizes a generation batch over every process (``generation_batch_size = per_device_train_batch_size x
    processes x steps_per_generation``) and repeats it ``num_iterations x steps_per_generation`` times, each process
    taking its slice of every repeat. The ranks of a context-parallel group draw the same batches (one data-parallel
    replica), so the batch the sampler repeats must be ``size`` times smaller: else a replica would take the first
    slices of each repeat again and never the others (measured: the prompts of the skipped slices never trained)."""
    size = trainer.context_parallel_size
    prompts = sampler.batch_size  # prompts per generation batch, over every process
    if prompts % size:
        raise ContextParallelError(
            f"context_parallel(size={size}): GRPO's generation batch of {prompts} prompts (generation_batch_size / "
            f"num_generations, over all {size * trainer._dp[0]} processes) does not divide over the "
            f"{trainer._dp[0]} data-parallel replica(s) of {size} ranks; make per_device_train_batch_size x "
            "steps_per_generation a multiple of num_generations.")
    sampler.batch_size = prompts // size
    return sampler


def _shard_over_data_parallel_ranks(loader, dp_size: int, dp_rank: int):
    """accelerate shards a loader's batches over all processes; under context parallelism the ranks of a group must
    draw the same batches, so the sharding is over the data-parallel ranks only."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if hasattr(batch_sampler, "process_index"):  # accelerate's BatchSamplerShard
        batch_sampler.num_processes, batch_sampler.process_index = dp_size, dp_rank
        return loader
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise ContextParallelError(
            "compilepack's context parallelism needs a map-style dataset (accelerate shards an iterable dataset by "
            "dispatching batches, which cannot give the ranks of a group the same batch); convert it with "
            "datasets' Dataset.from_generator or pass a list.")
    return loader  # one process: nothing was sharded


def _balanced_loader(trainer, sampler: BalancedBatchSampler):
    """The trainer's own loader around a BalancedBatchSampler, which is already per data-parallel rank: accelerate's
    re-sharding neutralised (as transformers does for its BatchRebalanceSampler) and its epoch set with the
    loader's."""
    from torch.utils.data import DataLoader

    args = trainer.args
    collate = trainer._get_collator_with_removed_columns(trainer.data_collator, description="Training")
    dataset = trainer.train_dataset
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            dataset, collate = trainer._remove_unused_columns(dataset, description="Training"), trainer.data_collator
    except ImportError:
        pass
    loader = trainer.accelerator.prepare(DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor,
    ))
    _shard_over_data_parallel_ranks(loader, 1, 0)
    set_epoch = loader.set_epoch

    @functools.wraps(set_epoch)
    def set_both(epoch: int) -> None:
        set_epoch(epoch)
        sampler.set_epoch(epoch)

    loader.set_epoch = set_both
    return loader


def _lengths(dataset) -> list[int]:
    """Token count of every item (its ``input_ids``)."""
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            return [len(ids) for ids in dataset[INPUT_IDS]]
    except ImportError:
        pass
    return [len(item[INPUT_IDS]) for item in dataset]


def _pad_token_id(trainer) -> int:
    """The token of the padding document shard_batch appends when a row does not divide by the group size."""
    for holder in (getattr(trainer, "processing_class", None), getattr(trainer.model, "config", None)):
        token = getattr(holder, "pad_token_id", None)
        if isinstance(token, int):
            return token
    return 0


def attention_length_of(model: torch.nn.Module) -> float:
    """:func:`~compilepack.distributed.document_cost`'s ``attention_length`` for a model: ``12 x hidden_size``
    (attention's quadratic term equals the linear layers' per-token cost there when every layer attends), divided
    by the fraction of its decoder layers that attend (a hybrid's linear-attention, Mamba and conv layers cost per
    token alone). The attending layers are the family's attention layers (``patches/<family>.py``), counted."""
    config = model.config.get_text_config()
    attending = {name for name, needed in family_of(model).layers.items() if ATTENTION in needed}
    count = sum(1 for module in model.modules() if type(module).__name__ in attending)
    fraction = min(1.0, count / config.num_hidden_layers) if count else 1.0
    return 12 * config.hidden_size / fraction
