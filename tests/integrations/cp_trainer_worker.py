"""torchrun worker for test_context_parallel_trainer.py: TRL's SFTTrainer (padding_free=True) and HF Trainer with
compilepack's context parallelism (``compilepack.integrations.context_parallel``), launched as users launch them.

    torchrun --standalone --nproc_per_node=4 tests/integrations/cp_trainer_worker.py --out DIR --cp 2 \\
        --cases run:sft:llama,run:sft:qwen3_5,resume:sft:qwen3_5,control-no-grad-sum:sft:llama

A case may name the mode as a fourth field (``run:sft:qwen3_5:sequence``, ``run:hf:bamba:hybrid``): the sequence and
hybrid modes (hybrid: Ulysses over 2 ranks) train the families' configs with fewer heads than ranks (``FEW_HEADS``:
2 query heads, 1 kv head).

Every case trains a tiny model of the family for ``STEPS`` optimizer steps on the same documents and rank 0
writes ``OUT/<case>-<family>.pt``: the logged training losses, the final weights, and whatever the case measures.
The single-process reference is computed by the test itself (``reference_run``), with the same trainer on one
process and ``dp`` times the per-device batch.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.*

STEPS = 4
PER_DEVICE_BATCH = 3
# Documents: past the mixers' 64-token chunk, 1-token ones, odd lengths (rows that do not divide by the group size).
LENGTHS = [37, 5, 70, 12, 1, 44, 20, 9, 66, 3, 30, 15, 7, 52, 28, 2, 61, 11, 40, 24, 6, 33, 19, 48]


def documents(vocab_size: int) -> list[list[int]]:
    from tests.models import random_docs

    return random_docs(vocab_size, LENGTHS, seed=7)


def tokenizer(vocab_size: int = 256):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    built = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    built.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=built, pad_token="t0", unk_token="t1", eos_token="t2")


def model_of(family_name: str, heads: str = "tiny") -> torch.nn.Module:
    """The family's tiny model; ``heads="few"``: its config with 2 query heads and 1 kv head (and one or two heads
    for the linear mixers), below the W = 4 of the sequence and hybrid cases."""
    from compilepack.patching import family_named
    from tests.distributed.sequence_worker import FEW_HEADS
    from tests.families import build_tiny, tiny_config

    torch.manual_seed(0)
    if heads == "tiny":
        return build_tiny(family_named(family_name)).train()
    import transformers

    config = tiny_config(family_named(family_name))
    for key, value in FEW_HEADS[family_name].items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def layout_of(mode: str) -> dict:
    """context_parallel()'s options for a case's mode (the hybrid: Ulysses over 2 ranks)."""
    return {"ulysses": {}, "sequence": dict(mode="sequence"), "hybrid": dict(mode="hybrid", ulysses_size=2)}[mode]


def heads_of(mode: str) -> str:
    return "tiny" if mode == "ulysses" else "few"


def arguments(kind: str, out: Path, batch: int, **overrides):
    """What every run shares: fp32 on the CPU, a fixed seed, every loss logged, gloo for several processes."""
    import torch.distributed as dist

    launched = dict(ddp_backend="gloo") if dist.is_initialized() else {}
    common = {**launched, **dict(
        output_dir=str(out), per_device_train_batch_size=batch, max_steps=STEPS, seed=0,
        data_seed=0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, remove_unused_columns=False, lr_scheduler_type="constant", bf16=False,
        # plain SGD, no clipping: Adam's update and a clipped gradient do not scale with the gradient, so a doubled
        # gradient (the sharding control) would leave the weights as they are
        optim="sgd", learning_rate=0.5, max_grad_norm=0.0,
    ), **overrides}
    if kind == "sft":
        from trl import SFTConfig

        return SFTConfig(padding_free=True, max_length=None, **common)
    from transformers import TrainingArguments

    return TrainingArguments(**common)


BALANCE_TOKENS = 160  # tokens per rank and step when documents are dealt by cost (context_parallel(balance=...))


def trainer_for(kind: str, family_name: str, out: Path, *, cp: int | None, batch: int, trainer_class=None,
                balance: int | None = None, mode: str = "ulysses", heads: str | None = None,
                lm_head: str | None = None, **overrides):
    """A trainer of ``kind`` ("sft": SFTTrainer(padding_free=True); "hf": Trainer with the HF flattening
    collator), context-parallel over groups of ``cp`` ranks in ``mode`` (cp None: plain, one process); ``heads``
    the config (None: the mode's, :func:`heads_of`); ``lm_head``: the model patched with it first (as a user
    would, before the trainer)."""
    from datasets import Dataset

    import compilepack
    from compilepack.integrations import context_parallel

    model = model_of(family_name, heads or heads_of(mode))
    if lm_head is not None:
        compilepack.patch(model, lm_head=lm_head)
    dataset = Dataset.from_dict({"input_ids": documents(model.config.get_text_config().vocab_size)})
    if kind == "sft":
        from trl import SFTTrainer

        base, extra = SFTTrainer, dict(processing_class=tokenizer())
    else:
        from transformers import DataCollatorWithFlattening, Trainer

        base = Trainer
        extra = dict(data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True))
    if cp is None:
        import compilepack

        compilepack.patch(model)
        trainer_class = trainer_class or base
    trainer_class = trainer_class or context_parallel(base, size=cp, balance=balance, **layout_of(mode))
    return trainer_class(model=model, args=arguments(kind, out, batch, **overrides), train_dataset=dataset, **extra)


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = getattr(model, "_orig_mod", model)  # the compiled case: the module torch.compile wraps
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ cases


def run(kind: str, family_name: str, out: Path, cp: int, **options) -> dict:
    folder = out / "-".join([kind, family_name, *map(str, options.values())])
    trainer = trainer_for(kind, family_name, folder, cp=cp, batch=PER_DEVICE_BATCH, **options)
    trainer.train()
    return {"losses": losses(trainer), "weights": weights(trainer.model)}


def chunked(kind: str, family_name: str, out: Path, cp: int, **options) -> dict:
    """The model patched with ``lm_head="chunked"`` before the trainer patches it for context parallelism: the
    head stays chunked (``chunked_head``) and the run is one process's (plain head)."""
    from compilepack.patching.chunked_head import has_chunked_head

    trainer = trainer_for(kind, family_name, out / f"chunked-{kind}-{family_name}", cp=cp, batch=PER_DEVICE_BATCH,
                          lm_head="chunked", **options)
    trainer.train()
    return {"losses": losses(trainer), "weights": weights(trainer.model), "chunked_head": has_chunked_head(
        trainer.accelerator.unwrap_model(trainer.model))}


def checkpointing(kind: str, family_name: str, out: Path, cp: int, **options) -> dict:
    """gradient_checkpointing=True: every layer's forward, collectives included, runs again in the backward."""
    return run(kind, family_name, out / "checkpointing", cp, gradient_checkpointing=True, **options)


def control_no_pass(kind: str, family_name: str, out: Path, cp: int, **options) -> dict:
    """The control of the sequence mode: no state pass and no conv halo (every rank's first document starts from
    zero). Its weights must miss one process's by far."""
    from tests.distributed.sequence_worker import _without_passing

    with _without_passing():
        return run(kind, family_name, out / "control-no-pass", cp, **options)


def resume(kind: str, family_name: str, out: Path, cp: int) -> dict:
    """Train 2 steps and save (model, optimizer, scheduler, RNG and the trainer's step); a new trainer resumes from
    that checkpoint for the last 2 steps. Its losses and weights must be the uninterrupted run's."""
    folder = out / f"resume-{kind}-{family_name}"
    first = trainer_for(kind, family_name, folder, cp=cp, batch=PER_DEVICE_BATCH, save_strategy="steps",
                        save_steps=2)
    first.train()
    second = trainer_for(kind, family_name, folder, cp=cp, batch=PER_DEVICE_BATCH)
    second.train(resume_from_checkpoint=str(folder / "checkpoint-2"))
    # the resumed trainer's log keeps the first two steps' entries (its state comes from the checkpoint)
    return {"losses": losses(second), "weights": weights(second.model)}


def balanced(kind: str, family_name: str, out: Path, cp: int) -> dict:
    """Documents dealt to the data-parallel ranks by cost (BalancedBatchSampler through the trainer): the plan
    (every step's documents per data-parallel rank), the losses and the weights."""
    trainer = trainer_for(kind, family_name, out / f"balanced-{kind}-{family_name}", cp=cp, batch=PER_DEVICE_BATCH,
                          balance=BALANCE_TOKENS)
    trainer.train()
    sampler = trainer._balanced_sampler()
    return {"losses": losses(trainer), "weights": weights(trainer.model), "plan": sampler.plan(0)}


def resume_balanced(kind: str, family_name: str, out: Path, cp: int) -> dict:
    """A balanced run resumed mid-epoch from its checkpoint: the sampler's epoch and the trainer's skipped steps
    give the uninterrupted run's batches."""
    folder = out / f"resume-balanced-{kind}-{family_name}"
    first = trainer_for(kind, family_name, folder, cp=cp, batch=PER_DEVICE_BATCH, balance=BALANCE_TOKENS,
                        save_strategy="steps", save_steps=2)
    first.train()
    second = trainer_for(kind, family_name, folder, cp=cp, batch=PER_DEVICE_BATCH, balance=BALANCE_TOKENS)
    second.train(resume_from_checkpoint=str(folder / "checkpoint-2"))
    return {"losses": losses(second), "weights": weights(second.model), "uninterrupted": losses(first),
            "uninterrupted_weights": weights(first.model)}


def control_no_grad_sum(kind: str, family_name: str, out: Path, cp: int) -> dict:
    """The control of the gradient sum: DDP's all-reduce replaced by a no-op hook, each rank steps on its own
    shard's gradient. Its weights must miss one process's by far."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__

    def without_sum(self, *args, **kwargs):
        init(self, *args, **kwargs)

        def keep_local(state, bucket):
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        self.register_comm_hook(None, keep_local)

    DistributedDataParallel.__init__ = without_sum
    try:
        return run(kind, family_name, out / "control-no-grad-sum", cp)
    finally:
        DistributedDataParallel.__init__ = init


def control_no_shard(kind: str, family_name: str, out: Path, cp: int) -> dict:
    """The control of the sharding: every rank of a group trains the whole batch (the model patched without context
    parallelism, the trainer's bookkeeping unchanged). Its weights must miss one process's by far."""
    import compilepack
    from compilepack.integrations import context_parallel

    trainer_class = context_parallel(_base(kind), size=cp)

    class Unsharded(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            compilepack.patch(self.model)  # re-patched without context parallelism

        def _prepare_context_parallel_inputs(self, model, inputs):
            return contextlib.nullcontext, inputs

    trainer = trainer_for(kind, family_name, out / "control-no-shard", cp=cp, batch=PER_DEVICE_BATCH,
                          trainer_class=Unsharded)
    trainer.train()
    return {"losses": losses(trainer), "weights": weights(trainer.model)}


def compiled(kind: str, family_name: str, out: Path, cp: int) -> dict:
    """The documented recipe under the trainer (torch_compile=True, aot_eager): graphs and breaks of each rank's
    compiled forward+backward, and compiles over the run's varied shards."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    trainer = trainer_for(kind, family_name, out / f"compiled-{kind}-{family_name}", cp=cp, batch=PER_DEVICE_BATCH,
                          torch_compile=True, torch_compile_backend="aot_eager")
    trainer.train()
    stats = dynamo_utils.counters["stats"]
    breaks = sum(dynamo_utils.counters["graph_break"].values())
    return {"losses": losses(trainer), "weights": weights(trainer.model), "unique_graphs": stats["unique_graphs"],
            "graph_breaks": breaks, "break_reasons": sorted(dynamo_utils.counters["graph_break"])}


def evaluate(kind: str, family_name: str, out: Path, cp: int) -> dict:
    """Evaluation under context parallelism: the eval loss over the (sharded) evaluation set, before training."""
    from datasets import Dataset

    trainer = trainer_for(kind, family_name, out / f"eval-{kind}-{family_name}", cp=cp, batch=PER_DEVICE_BATCH,
                          per_device_eval_batch_size=PER_DEVICE_BATCH)
    vocab = trainer.model.config.get_text_config().vocab_size
    eval_set = Dataset.from_dict({"input_ids": documents(vocab)[:12]})
    return {"eval_loss": trainer.evaluate(eval_dataset=eval_set)["eval_loss"]}


def _base(kind: str):
    if kind == "sft":
        from trl import SFTTrainer

        return SFTTrainer
    from transformers import Trainer

    return Trainer


CASES = {"run": run, "chunked": chunked, "checkpointing": checkpointing, "control-no-pass": control_no_pass,
         "resume": resume, "balanced": balanced, "resume-balanced": resume_balanced,
         "control-no-grad-sum": control_no_grad_sum,
         "control-no-shard": control_no_shard, "compiled": compiled, "evaluate": evaluate}


def main() -> None:
    from tests.integrations.common import run_launched_cases

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cp", type=int, required=True)
    parser.add_argument("--cases", required=True, help="comma-separated case:kind:family[:mode]")
    args = parser.parse_args()

    def run_spec(spec: str):
        case, kind, family_name, *mode = spec.split(":")
        return CASES[case](kind, family_name, args.out, args.cp, **({"mode": mode[0]} if mode else {}))

    run_launched_cases(args.cases, args.out, run_spec)


if __name__ == "__main__":
    main()
