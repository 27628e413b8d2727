"""Packed DPO and GRPO log-prob passes under compilepack's context parallelism (issue 51):
``packed_logprobs(context_parallel(DPOTrainer, size=2))`` and the factories the other way round, launched with
torchrun on 2 gloo processes (one group of 2), equal one process running ``packed_logprobs(DPOTrainer)``.

- The packed call (``rl_cp_worker.call``): per-token log-probs and entropies of TRL's GRPO and DPO layouts, and the
  gradient of their weighted sum (the ranks' gradients averaged, as DDP does), Ulysses on Qwen3.5, the sequence
  mode on Bamba; the control shards the packed row as one sequence (its boundaries dropped).
- The trainers: losses of every step and the final weights after SGD (which shows a gradient's scale: one counted
  twice would move the weights twice as far), DPO's evaluation loss, GRPO's sampled completions.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("trl")
pytest.importorskip("peft")

from tests.integrations import rl_cp_worker as worker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# fp32. Log-probs and entropies absolute (values ~5), gradients relative to the largest; measured: log-probs and
# entropies 0 (Ulysses: each token's LM head runs on its rank as it does alone) to 4.8e-7 (Bamba, sequence mode),
# gradients 2.0e-7 to 2.9e-7.
LOG_PROB_TOLERANCE, GRADIENT_TOLERANCE = 1e-5, 1e-5
# the control (boundaries dropped) must miss the log-probs by more than this (measured 0.086 and 0.090)
MIXED = 1e-2
# losses relative, every step; weights relative to the largest weight after 2 SGD steps (GRPO 3) at learning rate
# 0.5.
# Measured: losses <= 2.1e-7, DPO's evaluation loss <= 1.1e-6, weights <= 1.4e-6 (DPO), 2.6e-8 (GRPO).
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 1e-5

CALLS = ["call:qwen3_5", "call:bamba:sequence"]
TRAINERS = ["dpo:llama", "dpo:qwen3_5:reverse", "dpo:llama:lora", "grpo:llama", "grpo:qwen3_5"]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """One torchrun launch of every case (about 15 s on 2 cores; the file about 40 s)."""
    out = tmp_path_factory.mktemp("rl-cp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cases = CALLS + TRAINERS + ["evaluated_first:llama"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(worker.__file__)), "--out", str(out), "--cases", ",".join(cases)]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stderr[-6000:]}"
    return {case: torch.load(out / f"{case.replace(':', '-')}.pt") for case in cases}


@functools.cache
def one_process(case: str, path: str) -> dict:
    """The same trainer, packed, without context parallelism, on one process."""
    kind, family_name, *option = case.split(":")
    out = Path(path) / f"one-process-{kind}-{family_name}-{'-'.join(option)}"
    if kind == "grpo":
        trainer = worker.grpo_trainer(family_name, out, cp=None)
        trainer.train()
        return {"losses": worker.losses(trainer), "weights": worker.weights(trainer.model), **worker.samples(trainer)}
    return worker.trained_and_evaluated(
        worker.dpo_trainer(family_name, out, cp=None, option=(option or ["packed-outside"])[0]))


def relative_loss_error(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) and len(got) in (worker.STEPS, worker.GRPO_STEPS), (got, want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def weight_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want) / max(v.abs().max().item() for v in want.values())


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CALLS)
def test_a_sharded_packed_call_equals_the_unsharded_one_and_the_control_misses(launched, case):
    got = launched[case]
    assert got["log_probs"] <= LOG_PROB_TOLERANCE and got["entropy"] <= LOG_PROB_TOLERANCE, got
    assert got["gradient"] <= GRADIENT_TOLERANCE, got
    assert got["control"] > MIXED, got


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TRAINERS)
def test_context_parallel_dpo_and_grpo_train_as_one_process(launched, case, tmp_path_factory):
    """DPO (full fine-tuning, a separate reference model, both sharded; LoRA, the reference the adapter-disabled
    policy) and GRPO (generation on every rank of the group, seeded alike; the reference TRL loads, KL 0.1; each
    generation batch used twice, the second time with the old policy's log-probs): every step's loss, the final
    weights, DPO's evaluation loss, GRPO's prompts and samples (a group drawing one process's generation batches)."""
    got, want = launched[case], one_process(case, str(tmp_path_factory.getbasetemp()))
    assert relative_loss_error(got["losses"], want["losses"]) <= LOSS_TOLERANCE, (got["losses"], want["losses"])
    assert weight_error(got["weights"], want["weights"]) <= WEIGHT_TOLERANCE
    if case.startswith("grpo"):  # the same prompts in the same steps (each generation used twice), the same samples
        assert got["prompts"] == want["prompts"] and got["completions"] == want["completions"]
        assert min(got["completion_lengths"]) == 1 and max(got["completion_lengths"]) == 16
    else:
        assert abs(got["eval_loss"] - want["eval_loss"]) / want["eval_loss"] <= LOSS_TOLERANCE


@pytest.mark.multiprocess
def test_a_peft_policy_evaluated_before_training_is_refused_not_trained_apart(launched):
    """HF Trainer trains outside DDP after an evaluate() before train() (a PEFT policy): each rank would step on its
    own gradient. Refused at the first training step (before the guard it trained: each rank's weights moved by
    twice the one-process gradient)."""
    got = launched["evaluated_first:llama"]
    assert "bare PeftModel, not wrapped by DDP" in got.get("refused", ""), got


# ------------------------------------------------------------------------------------------------ in one process


def test_dpo_or_grpo_under_context_parallel_without_packed_passes_is_refused(tmp_path):
    """Their batches are padded: shard_batch could not cut them. Refused before the trainer is built."""
    from trl import DPOTrainer

    from compilepack.errors import ContextParallelError
    from compilepack.integrations import context_parallel

    with pytest.raises(ContextParallelError, match=r"packed_logprobs\(context_parallel\(DPOTrainer, size=\.\.\.\)\)"):
        context_parallel(DPOTrainer, size=2)(model=None, args=None)


@pytest.mark.parametrize("order", ["packed-outside", "reverse"])
def test_balance_with_packed_passes_is_refused_in_either_order(order):
    from trl import DPOTrainer

    from compilepack.errors import ContextParallelError
    from compilepack.integrations import context_parallel, packed_logprobs

    cls = (packed_logprobs(context_parallel(DPOTrainer, size=2, balance=64)) if order == "packed-outside"
           else context_parallel(packed_logprobs(DPOTrainer), size=2, balance=64))
    with pytest.raises(ContextParallelError, match=r"balance=\.\.\.\) deals SFT documents"):
        cls(model=None, args=None)


def test_router_logits_under_context_parallel_are_refused():
    """The MoE aux loss of a rank would be its slice's: refused before any collective."""
    import compilepack
    from compilepack.errors import ContextParallelError
    from compilepack.integrations.rl_trainers import PackedModelCall
    from compilepack.patching import family_named
    from tests.families import build_tiny
    from tests.integrations.test_rl_adapters import dpo_batch

    batch, _, _ = dpo_batch(64)
    call = PackedModelCall(compilepack.patch(build_tiny(family_named("llama"))), context_parallel=object())
    with pytest.raises(ContextParallelError, match="output_router_logits=True"):
        call(**batch, fused_lm_head=True, output_router_logits=True)


def test_grpo_generation_batches_are_sized_per_data_parallel_replica():
    """TRL sizes GRPO's generation batch over every process; a context-parallel group is one replica, so the
    repeated batch is the group size times smaller (the trainer runs test this above), and one that does not divide
    is refused, naming the options."""
    from types import SimpleNamespace

    from trl.trainer.utils import RepeatSampler

    from compilepack.errors import ContextParallelError
    from compilepack.integrations.context_parallel_trainer import _per_replica

    trainer = SimpleNamespace(context_parallel_size=2, _dp=(1, 0))
    sampler = RepeatSampler(list(range(16)), mini_repeat_count=2, batch_size=8, repeat_count=2, seed=0)
    assert _per_replica(sampler, trainer).batch_size == 4
    odd = RepeatSampler(list(range(16)), mini_repeat_count=2, batch_size=3, repeat_count=2, seed=0)
    with pytest.raises(ContextParallelError, match="make per_device_train_batch_size x steps_per_generation"):
        _per_replica(odd, trainer)


def test_compiled_passes_under_context_parallel_are_refused(tmp_path):
    """Not exact yet (a LoRA policy's compiled reference pass scored as the policy): refused when the trainer is
    built, before the launch's mesh and any compute."""
    from trl import DPOConfig, DPOTrainer

    from compilepack.errors import ContextParallelError
    from compilepack.integrations import context_parallel, packed_logprobs
    from compilepack.patching import family_named
    from tests.families import build_tiny
    from tests.integrations.test_dpo import pairs
    from tests.integrations.test_trl import word_tokenizer

    model = build_tiny(family_named("llama"))
    args = DPOConfig(output_dir=str(tmp_path), bf16=False, report_to=[], use_cpu=True, max_steps=1,
                     torch_compile=True, torch_compile_backend="aot_eager")
    with pytest.raises(ContextParallelError, match="torch_compile=True with packed DPO / GRPO passes"):
        packed_logprobs(context_parallel(DPOTrainer, size=2))(
            model=model, ref_model=build_tiny(family_named("llama")), args=args,
            train_dataset=pairs(model.config.vocab_size), processing_class=word_tokenizer(model.config.vocab_size))
