"""TRL's GRPOTrainer with packed log-prob passes (issue 51): ``packed_logprobs(GRPOTrainer)`` scores the policy, the
old policy (``num_iterations=2``) and the reference (``beta > 0``) as packed rows, and trains with the losses of TRL's
own padded GRPOTrainer on the same prompts and seeds (the same completions: generation is stock's in both), full
fine-tuning (the reference loaded by TRL from the policy's checkpoint) and LoRA (the adapter-disabled policy), eager
and compiled to one graph. Prompts are left-padded, completions right-padded, from 1 token to cut at
``max_completion_length``. The control: the boundaries dropped, the losses miss by far.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

import compilepack
from compilepack.integrations import packed_logprobs
from compilepack.patching import family_named
from tests.families import build_tiny
from tests.integrations.common import TRAINING_ARGS, recording
from tests.integrations.test_dpo import LORA, assert_compiled_run_equals_eager, compiled_runs, worst_loss_difference
from tests.integrations.test_rl_adapters import without_boundaries
from tests.integrations.test_trl import word_tokenizer

# Qwen3.5 is the case of a model TRL loads with Hub kernels (patch() turns them off, patching/api.py
# _turn_off_hub_kernels): before that, model.train() dropped compilepack's Gated DeltaNet forwards and these tests
# failed on Qwen3.5 (issue 51's note).
FAMILIES = ["llama", "qwen3_5", "qwen3_next", "bamba"]
# fp32 GRPO losses, packed vs TRL's padded trainer, every step
LOSS_TOLERANCE = 1e-5
MIXED = 1e-3  # the boundaries dropped must miss by more than this
STEPS = 4
PROMPT_LENGTHS = [3, 17, 6, 40, 1, 9, 25, 12]
MAX_COMPLETION = 16
# every one of these ends a completion (about 1 in 7 tokens): lengths from 1 token to cut at MAX_COMPLETION
EOS_TOKENS = list(range(2, 40))


def prompts(vocab_size: int):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    return Dataset.from_list([
        {"prompt": " ".join(f"t{i}" for i in torch.randint(40, vocab_size, (n,), generator=generator).tolist())}
        for n in PROMPT_LENGTHS])


def reward_length(completions, **kwargs) -> list[float]:
    return [float(len(completion.split())) for completion in completions]


def checkpoint(family_name: str, path) -> str:
    """A tiny model saved with its EOS tokens, for TRL to load the policy and the reference from."""
    torch.manual_seed(0)
    model = build_tiny(family_named(family_name))
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS_TOKENS, 0
    model.save_pretrained(path)
    return str(path)


def grpo_trainer(trainer_class, family_name, tmp_path, *, lora=False, compile_=False, **config):
    """GRPO, 4 steps of 4 prompts x 2 completions, each batch used twice (the old policy's pass), fp32, KL to the
    reference (beta 0.1); ``config``: more GRPOConfig options."""
    path = checkpoint(family_name, tmp_path / "model")
    settings = {**TRAINING_ARGS, "max_steps": STEPS, "per_device_train_batch_size": 8, "torch_compile": compile_}
    if not compile_:
        settings["torch_compile_backend"] = None
    args = GRPOConfig(output_dir=str(tmp_path / "out"), bf16=False, num_generations=2, beta=0.1, num_iterations=2,
                      max_completion_length=MAX_COMPLETION, seed=0, **settings, **config)
    tokenizer = word_tokenizer(256)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA[family_name], init_lora_weights=False)
    trainer = recording(trainer_class)(
        model=path, reward_funcs=reward_length, args=args, train_dataset=prompts(256), processing_class=tokenizer,
        peft_config=peft_config if lora else None)
    trainer.train()
    assert len(trainer.recorded_losses) == STEPS
    return trainer


@pytest.mark.slow  # two Qwen3-Next trainers
def test_qwen3_next_compiles_with_the_router_aux_loss_off(tmp_path, monkeypatch):
    """As test_dpo's: without the router aux loss, TRL asks no router logits and the packed GRPO passes compile to
    one graph (LoRA), no break, with the eager losses."""
    make = functools.partial(grpo_trainer, packed_logprobs(GRPOTrainer), "qwen3_next", tmp_path, lora=True,
                             router_aux_loss_coef=0.0)
    assert_compiled_run_equals_eager(make, True, monkeypatch)


def completion_lengths(trainer) -> list[int]:
    return [int(n) for batch in trainer.recorded_batches for n in batch["completion_mask"].sum(1)]


@pytest.mark.slow  # 3-4 s a case on 2 idle cores (generation included), minutes under load
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family_name", FAMILIES)
def test_packed_grpo_losses_equal_trls_padded_trainer(family_name, lora, tmp_path, monkeypatch):
    padded = grpo_trainer(GRPOTrainer, family_name, tmp_path, lora=lora)
    packed = grpo_trainer(packed_logprobs(GRPOTrainer), family_name, tmp_path, lora=lora)
    assert compilepack.is_patched(packed.model) and not compilepack.is_patched(padded.model)
    lengths = completion_lengths(packed)
    assert lengths == completion_lengths(padded)  # the same completions
    assert min(lengths) <= MAX_COMPLETION // 4 and max(lengths) == MAX_COMPLETION, lengths  # spread, some cut
    assert packed.recorded_batches[0]["prompt_mask"].eq(0).any()  # prompts left-padded
    assert worst_loss_difference(packed, padded) <= LOSS_TOLERANCE, (packed.recorded_losses, padded.recorded_losses)

    without_boundaries(monkeypatch)
    mixed = grpo_trainer(packed_logprobs(GRPOTrainer), family_name, tmp_path, lora=lora)
    assert worst_loss_difference(mixed, padded) > MIXED, (mixed.recorded_losses, padded.recorded_losses)


@pytest.mark.slow
@pytest.mark.parametrize(("family_name", "lora"), compiled_runs("grpo"))
def test_packed_grpo_compiled_one_graph_no_break(family_name, lora, tmp_path, monkeypatch):
    """torch_compile=True over 4 steps of varying lengths: one graph per model (``GRAPHS_PER_RUN``), no break, no
    recompile; the losses are the eager packed trainer's."""
    make = functools.partial(grpo_trainer, packed_logprobs(GRPOTrainer), family_name, tmp_path, lora=lora)
    assert_compiled_run_equals_eager(make, lora, monkeypatch)
