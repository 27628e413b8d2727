"""torchrun worker for test_rl_context_parallel.py: packed DPO and GRPO log-prob passes under compilepack's context
parallelism (``packed_logprobs(context_parallel(...))``), on 2 gloo processes, one group of 2.

    torchrun --standalone --nproc_per_node=2 tests/integrations/rl_cp_worker.py --out DIR \\
        --cases call:llama,dpo:qwen3_5:reverse,grpo:bamba

Cases (``case:family[:option]``):

- ``call``: TRL's padded layouts (GRPO's and DPO's, ``test_rl_adapters``) through :class:`PackedModelCall` on the
  context-parallel model vs the same call unsharded on a copy (in the worker): the per-token log-probs, entropies,
  and the gradient of a weighted sum of the log-probs, the ranks' gradients averaged as DDP does; the control: the
  packed row sharded as one sequence (its boundaries dropped). Option: the mode (``sequence``; Ulysses otherwise).
- ``dpo``: ``packed_logprobs(context_parallel(DPOTrainer, size=2))`` trained ``STEPS`` SGD steps (option
  ``reverse``: the factories the other way round; ``lora``: a LoRA policy, its reference the adapter-disabled
  policy), and its evaluation loss after training.
- ``grpo``: ``packed_logprobs(context_parallel(GRPOTrainer, size=2))``, generation included, KL to the reference,
  each generation batch used twice (the old policy's pass), ``GRPO_STEPS`` steps.
- ``evaluated_first``: the LoRA DPO case with ``evaluate()`` before ``train()``, which HF Trainer then trains
  outside DDP: the refusal's message, or the losses if it trained.

Rank 0 writes ``OUT/<case>.pt``; the trainer cases' single-process references are the same builders with ``cp=None``,
run by the test.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.*

STEPS = 2
GRPO_BATCH = 8  # 4 prompts x 2 generations a step
# each generation batch used twice (num_iterations=2: the old policy's pass); the third step generates again
GRPO_STEPS = 3


def arguments(config_class, out: Path, batch: int, **overrides):
    """fp32 on the CPU, fixed seeds, every loss logged, plain SGD without clipping (the weights see the gradient's
    scale: a gradient counted twice would show), gloo when launched."""
    import torch.distributed as dist

    launched = dict(ddp_backend="gloo") if dist.is_initialized() else {}
    return config_class(**{**launched, **dict(
        output_dir=str(out), per_device_train_batch_size=batch, max_steps=STEPS, seed=0, data_seed=0, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
        remove_unused_columns=False, lr_scheduler_type="constant", optim="sgd", learning_rate=0.5, max_grad_norm=0.0,
    ), **overrides})


def trainer_class(base, cp: int | None, order: str = "packed-outside"):
    """``packed_logprobs(base)``, under ``context_parallel(..., size=cp)`` in either order when ``cp``."""
    from compilepack.integrations import context_parallel, packed_logprobs
    from tests.integrations.common import recording

    if cp is None:
        return recording(packed_logprobs(base))
    if order == "reverse":
        return recording(context_parallel(packed_logprobs(base), size=cp))
    return recording(packed_logprobs(context_parallel(base, size=cp)))


def dpo_trainer(family_name: str, out: Path, *, cp: int | None, option: str = "packed-outside"):
    """DPO on a tiny model, 3 pairs a step; its reference another initialisation, or (``option="lora"``) the
    adapter-disabled policy (adapters initialised non-zero: the two differ from the first step)."""
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    from compilepack.patching import family_named
    from tests.families import build_tiny
    from tests.integrations.test_dpo import LORA, pairs
    from tests.integrations.test_trl import word_tokenizer

    torch.manual_seed(0)
    model = build_tiny(family_named(family_name))
    torch.manual_seed(1)
    lora = option == "lora"
    ref_model = None if lora else build_tiny(family_named(family_name))
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA[family_name], init_lora_weights=False)
    vocab = model.config.vocab_size
    # the evaluation set in whole batches: accelerate's gather_for_metrics drops a partial last batch's
    # "duplicates", which the ranks of a context-parallel group are not
    args = arguments(DPOConfig, out, 3, max_length=None, per_device_eval_batch_size=3)
    return trainer_class(DPOTrainer, cp, option)(
        model=model, ref_model=ref_model, args=args, train_dataset=pairs(vocab), processing_class=word_tokenizer(vocab),
        peft_config=peft_config if lora else None)


def grpo_trainer(family_name: str, out: Path, *, cp: int | None):
    """GRPO from a tiny checkpoint (TRL loads the policy and, beta > 0, the reference), 4 prompts x 2 completions
    a step, completions from 1 token to cut at the maximum."""
    import torch.distributed as dist
    from trl import GRPOConfig, GRPOTrainer

    from tests.integrations.test_grpo import MAX_COMPLETION, checkpoint, prompts, reward_length
    from tests.integrations.test_trl import word_tokenizer

    path = out / "model"
    if not dist.is_initialized() or dist.get_rank() == 0:
        checkpoint(family_name, path)
    if dist.is_initialized():
        dist.barrier()
    args = arguments(GRPOConfig, out / "out", GRPO_BATCH, num_generations=2, beta=0.1, num_iterations=2,
                     max_completion_length=MAX_COMPLETION, max_steps=GRPO_STEPS)
    return trainer_class(GRPOTrainer, cp)(model=str(path), reward_funcs=reward_length, args=args,
                                          train_dataset=prompts(256), processing_class=word_tokenizer(256))


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)  # DDP's
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ cases


def call(family_name: str, out: Path, mode: str = "ulysses") -> dict:
    """The worst differences, sharded vs unsharded packed call, over GRPO's and DPO's layouts."""
    import torch.distributed as dist
    from trl.trainer.utils import add_fused_lm_head

    import compilepack
    from compilepack.distributed import ContextParallel
    from compilepack.integrations.rl_trainers import PackedModelCall
    from compilepack.patching import family_named
    from tests.families import build_tiny
    from tests.integrations.test_rl_adapters import dpo_batch, grpo_batch

    torch.manual_seed(0)
    model = build_tiny(family_named(family_name)).train()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    alone = compilepack.patch(copy.deepcopy(model))
    group = dist.group.WORLD
    cp = ContextParallel.sequence_parallel(group) if mode == "sequence" else ContextParallel.of(group)
    compilepack.patch(model, context_parallel=cp)
    result = {"log_probs": 0.0, "entropy": 0.0, "gradient": 0.0, "control": float("inf")}
    for layout in (grpo_batch, dpo_batch):
        batch, _, _ = layout(model.config.vocab_size)
        sharded = PackedModelCall(model, context_parallel=cp)(**batch, fused_lm_head=True)
        whole = PackedModelCall(alone)(**batch, fused_lm_head=True)
        result["log_probs"] = max(result["log_probs"], _worst(sharded.log_probs, whole.log_probs))
        result["entropy"] = max(result["entropy"], _worst(sharded.entropy, whole.entropy))
        result["gradient"] = max(result["gradient"], _gradient_error(model, alone, sharded, whole, group))
        with _boundaries_dropped(), torch.no_grad():
            mixed = PackedModelCall(model, context_parallel=cp)(**batch, fused_lm_head=True)
        result["control"] = min(result["control"], _worst(mixed.log_probs, whole.log_probs))
    return result


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.detach() - want.detach()).abs().max().item()


def _gradient_error(model, alone, sharded, whole, group) -> float:
    """Relative to the largest gradient: the ranks' gradients of the same weighted sum, averaged over the group
    (DDP's mean), vs the unsharded call's."""
    import torch.distributed as dist

    scale = torch.randn(whole.log_probs.shape, generator=torch.Generator().manual_seed(3))
    (sharded.log_probs * scale).sum().backward()
    (whole.log_probs * scale).sum().backward()
    worst, largest = 0.0, 0.0
    for got, want in zip(model.parameters(), alone.parameters()):
        mean = got.grad.clone()
        dist.all_reduce(mean, group=group)
        mean /= dist.get_world_size(group)
        worst, largest = max(worst, _worst(mean, want.grad)), max(largest, want.grad.abs().max().item())
        got.grad, want.grad = None, None
    return worst / largest


@contextlib.contextmanager
def _boundaries_dropped():
    """The control: the packed row sharded and run as one sequence (one document over all its tokens)."""
    from compilepack.batch.layout import Boundaries
    from compilepack.integrations import rl_trainers

    pack = rl_trainers._packed_inputs

    def one_sequence(*args):
        packed = pack(*args)
        return {**packed, **Boundaries.from_lengths([packed["input_ids"].shape[1]]).as_kwargs()}

    rl_trainers._packed_inputs = one_sequence
    try:
        yield
    finally:
        rl_trainers._packed_inputs = pack


def dpo(family_name: str, out: Path, option: str = "packed-outside") -> dict:
    trainer = dpo_trainer(family_name, out / f"dpo-{family_name}-{option}", cp=2, option=option)
    return trained_and_evaluated(trainer)


def trained_and_evaluated(trainer) -> dict:
    """Losses and weights of the run, and the evaluation loss after it (before it, see ``evaluated_first``)."""
    trainer.train()
    eval_loss = trainer.evaluate(eval_dataset=trainer.train_dataset)["eval_loss"]
    return {"losses": losses(trainer), "weights": weights(trainer.model), "eval_loss": eval_loss}


def grpo(family_name: str, out: Path) -> dict:
    trainer = grpo_trainer(family_name, out / f"grpo-{family_name}", cp=2)
    trainer.train()
    return {"losses": losses(trainer), "weights": weights(trainer.model), **samples(trainer)}


def samples(trainer) -> dict:
    """Every step's prompts and sampled completions (token ids, padding included), and the completions' lengths."""
    batches = trainer.recorded_batches
    return {"prompts": [batch["prompt_ids"].tolist() for batch in batches],
            "completions": [batch["completion_ids"].tolist() for batch in batches],
            "completion_lengths": [int(n) for batch in batches for n in batch["completion_mask"].sum(1)]}


def evaluated_first(family_name: str, out: Path) -> dict:
    """A PEFT policy evaluated before training: HF Trainer keeps the evaluation's unwrapped model and skips
    accelerate's DDP, so each rank would step on its own gradient; the context-parallel trainer refuses it."""
    from compilepack.errors import ContextParallelError

    trainer = dpo_trainer(family_name, out / f"evaluated-first-{family_name}", cp=2, option="lora")
    trainer.evaluate(eval_dataset=trainer.train_dataset)
    try:
        trainer.train()
    except ContextParallelError as refusal:
        return {"refused": str(refusal)}
    return {"losses": losses(trainer)}


CASES = {"call": call, "dpo": dpo, "grpo": grpo, "evaluated_first": evaluated_first}


def main() -> None:
    from tests.integrations.common import run_launched_cases

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True, help="comma-separated case:family[:option]")
    args = parser.parse_args()

    def run(spec: str):
        case, family_name, *option = spec.split(":")
        return CASES[case](family_name, args.out, *option)

    run_launched_cases(args.cases, args.out, run)


if __name__ == "__main__":
    main()
