"""compilepack's context parallelism from TRL's SFTTrainer (padding_free=True) and HF Trainer, launched with torchrun
on gloo: W = 2 (one group of 2) and W = 4 (2 data-parallel replicas x groups of 2) match one process.

Each launch runs several cases (``cp_trainer_worker.py``); the single-process reference is the same trainer class,
unpatched for context parallelism, with ``dp`` times the per-device batch (the ranks of a data-parallel step see
``dp`` consecutive batches of the same seeded order). SGD without clipping, so the weights see the gradient's scale.
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

pytest.importorskip("trl", reason="TRL is an optional test dependency: pip install 'trl>=1.16'")

from tests.integrations import cp_trainer_worker as worker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# fp32, relative: the losses to the logged precision of two summation orders, the weights to the largest weight.
# Measured (llama, qwen3_5, bamba; W = 2 and 4): losses <= 2e-7, weights <= 2e-7.
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 1e-5
CONTROL_MISS = 1e-2  # a control must miss the weights by at least this (measured 0.24 and 0.31)

WORLD2 = ["run:sft:llama", "run:sft:qwen3_5", "run:sft:bamba", "run:hf:qwen3_5", "resume:sft:qwen3_5",
          "control-no-grad-sum:sft:llama", "control-no-shard:sft:llama", "compiled:hf:llama", "evaluate:sft:llama",
          "evaluate:hf:qwen3_5", "resume-balanced:sft:llama"]
WORLD4 = ["run:sft:llama", "run:sft:qwen3_5", "run:sft:bamba", "evaluate:hf:bamba", "balanced:sft:qwen3_5"]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _launch(tmp_path_factory, processes: int, cases: list[str], cp: int = 2) -> dict:
    out = tmp_path_factory.mktemp(f"cp-trainer-{processes}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               str(Path(worker.__file__)), "--out", str(out), "--cp", str(cp), "--cases", ",".join(cases)]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stderr[-6000:]}"
    return {case: torch.load(out / f"{case.replace(':', '-')}.pt") for case in cases}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _launch(tmp_path_factory, 2, WORLD2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _launch(tmp_path_factory, 4, WORLD4)


@functools.cache
def reference(kind: str, family_name: str, dp: int, path: str) -> dict:
    trainer = worker.trainer_for(kind, family_name, Path(path) / f"{kind}-{family_name}-{dp}", cp=None,
                                 batch=worker.PER_DEVICE_BATCH * dp)
    trainer.train()
    return {"losses": worker.losses(trainer), "weights": worker.weights(trainer.model)}


@functools.cache
def reference_eval(kind: str, family_name: str, dp: int, path: str) -> float:
    from datasets import Dataset

    trainer = worker.trainer_for(kind, family_name, Path(path) / f"eval-{kind}-{family_name}-{dp}", cp=None,
                                 batch=worker.PER_DEVICE_BATCH * dp,
                                 per_device_eval_batch_size=worker.PER_DEVICE_BATCH * dp)
    vocab = trainer.model.config.get_text_config().vocab_size
    return trainer.evaluate(eval_dataset=Dataset.from_dict({"input_ids": worker.documents(vocab)[:12]}))["eval_loss"]


def loss_error(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) == worker.STEPS, (got, want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def weight_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want) / max(v.abs().max().item() for v in want.values())


def _split(case: str) -> tuple[str, str]:
    _, kind, family_name = case.split(":")
    return kind, family_name


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [c for c in WORLD2 if c.startswith(("run:", "resume:", "compiled:"))])
def test_two_ranks_one_group_train_as_one_process(world2, case, tmp_path_factory):
    """Losses of every step and final weights: SFTTrainer (its padding-free collator, its fused LM head) and HF
    Trainer, eager and compiled, and a run resumed mid-epoch from a checkpoint."""
    want = reference(*_split(case), 1, str(tmp_path_factory.getbasetemp()))
    got = world2[case]
    assert loss_error(got["losses"], want["losses"]) <= LOSS_TOLERANCE, (got["losses"], want["losses"])
    assert weight_error(got["weights"], want["weights"]) <= WEIGHT_TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [c for c in WORLD4 if c.startswith("run:")])
def test_two_replicas_of_two_rank_groups_train_as_one_process(world4, case, tmp_path_factory):
    """dp = 2 x cp = 2: each replica's group draws its own batches; DDP over all four ranks sums the groups'
    gradients and averages the replicas: one process with twice the batch."""
    want = reference(*_split(case), 2, str(tmp_path_factory.getbasetemp()))
    got = world4[case]
    assert loss_error(got["losses"], want["losses"]) <= LOSS_TOLERANCE, (got["losses"], want["losses"])
    assert weight_error(got["weights"], want["weights"]) <= WEIGHT_TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["control-no-grad-sum:sft:llama", "control-no-shard:sft:llama"])
def test_controls_without_the_gradient_sum_or_the_sharding_miss_by_far(world2, case, tmp_path_factory):
    want = reference(*_split(case), 1, str(tmp_path_factory.getbasetemp()))
    assert weight_error(world2[case]["weights"], want["weights"]) >= CONTROL_MISS


@pytest.mark.multiprocess
def test_a_compiled_trainer_step_is_one_graph_per_rank_without_recompiles(world2):
    """torch_compile=True: the patched model compiled with fullgraph and dynamic inside DDP, one graph for the
    run's four steps of varied shard lengths (dynamo's unique graphs), no break."""
    got = world2["compiled:hf:llama"]
    assert (got["unique_graphs"], got["graph_breaks"]) == (1, 0), got["break_reasons"]


@pytest.mark.parametrize("world, case, dp", [("world2", "evaluate:sft:llama", 1), ("world2", "evaluate:hf:qwen3_5", 1),
                                             ("world4", "evaluate:hf:bamba", 2)])
@pytest.mark.multiprocess
def test_evaluation_loss_is_one_process_loss(world, case, dp, request, tmp_path_factory):
    got = request.getfixturevalue(world)[case]["eval_loss"]
    want = reference_eval(*_split(case), dp, str(tmp_path_factory.getbasetemp()))
    assert abs(got - want) / want <= LOSS_TOLERANCE, (got, want)


class _UnionOfRanks:
    """One process's batches of a balanced plan: every step's documents of all data-parallel ranks, in one batch."""

    def __init__(self, sampler):
        self.sampler, self.epoch = sampler, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for step in self.sampler.plan(self.epoch):
            yield [index for share in step for index in share]

    def __len__(self) -> int:
        return len(self.sampler.plan(self.epoch))


@pytest.mark.multiprocess
def test_documents_dealt_by_cost_from_the_trainer_train_as_one_process(world4, tmp_path_factory):
    """context_parallel(SFTTrainer, size=2, balance=...): a BalancedBatchSampler over the 2 data-parallel ranks
    (its cost model from the model: Qwen3.5's one attention layer in three), the ranks of each group sharing the
    batch. Every rank gets documents in every step, and the run equals one process training on the union of the
    ranks' documents of each step."""
    from compilepack.distributed import BalancedBatchSampler
    from compilepack.integrations import attention_length_of
    from compilepack.integrations.context_parallel_trainer import _balanced_loader

    got = world4["balanced:sft:qwen3_5"]
    plan = got["plan"]
    assert plan and all(len(step) == 2 and all(step) for step in plan), plan
    assert sorted(i for step in plan for share in step for i in share) == list(range(len(worker.LENGTHS)))

    class OneProcess(worker._base("sft")):
        def get_train_dataloader(self):
            model = self.accelerator.unwrap_model(self.model)
            sampler = BalancedBatchSampler([len(ids) for ids in self.train_dataset["input_ids"]], 2, 0,
                                           worker.BALANCE_TOKENS, seed=0, attention_length=attention_length_of(model))
            return _balanced_loader(self, _UnionOfRanks(sampler))

    trainer = worker.trainer_for("sft", "qwen3_5", tmp_path_factory.mktemp("balanced-reference"), cp=None,
                                 batch=worker.PER_DEVICE_BATCH, trainer_class=OneProcess)
    trainer.train()
    assert loss_error(got["losses"], worker.losses(trainer)) <= LOSS_TOLERANCE
    assert weight_error(got["weights"], worker.weights(trainer.model)) <= WEIGHT_TOLERANCE


@pytest.mark.multiprocess
def test_a_balanced_run_resumed_from_its_checkpoint_continues_identically(world2):
    got = world2["resume-balanced:sft:llama"]
    assert got["losses"] == got["uninterrupted"]
    assert weight_error(got["weights"], got["uninterrupted_weights"]) == 0.0


# ------------------------------------------------------------------------------------------------ in one process


@pytest.mark.parametrize("setting", [dict(cp_size=2), dict(sp_size=2)], ids=["cp_size", "sp_size"])
def test_accelerates_own_cp_and_sp_are_refused_naming_compilepacks_way(setting, tmp_path):
    """accelerate's ring attention (cp_size) and DeepSpeed Ulysses (sp_size) split the tokens, not the boundaries,
    and only attention: never run beside (or instead of) compilepack's, refused before the trainer is built."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import Trainer, TrainingArguments

    from compilepack.errors import ContextParallelError
    from compilepack.integrations import context_parallel

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             parallelism_config=ParallelismConfig(**setting))
    name = next(iter(setting))
    with pytest.raises(ContextParallelError, match=rf"sets {name}=2: .*compilepack.integrations.context_parallel"):
        context_parallel(Trainer, size=2)(model=worker.model_of("llama"), args=args)


def test_tokens_sliced_without_their_boundaries_are_refused_naming_compilepacks_way():
    """What another library's context or sequence parallelism hands a patched model (each rank's slice of the
    tokens, the whole rows' boundaries) is refused, and the message says what to use instead."""
    import compilepack
    from tests.models import hf_batch

    model = compilepack.patch(worker.model_of("qwen3_5"))
    batch = hf_batch(worker.documents(256)[:3])
    half = batch["input_ids"].shape[1] // 2
    sliced = {**batch, **{key: batch[key][:, :half] for key in ("input_ids", "labels", "position_ids")}}
    sliced.pop("seq_idx")
    with pytest.raises(compilepack.BoundaryError, match="use compilepack's context parallelism instead"):
        model(**sliced)


def test_the_cost_model_counts_attention_for_the_layers_that_attend():
    """12 x hidden for a model whose every layer attends (tiny Llama: hidden 64), divided by the attending
    fraction for hybrids (tiny Qwen3.5 and Bamba: one attention layer in three)."""
    from compilepack.integrations import attention_length_of

    assert attention_length_of(worker.model_of("llama")) == 12 * 64
    assert (attention_length_of(worker.model_of("qwen3_5")) == attention_length_of(worker.model_of("bamba"))
            == 12 * 64 * 3)


def test_without_a_distributed_launch_the_trainer_says_how_to_launch(tmp_path):
    from transformers import Trainer, TrainingArguments

    from compilepack.errors import ContextParallelError
    from compilepack.integrations import context_parallel

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ContextParallelError, match="torchrun --nproc_per_node 2"):
        context_parallel(Trainer, size=2)(model=worker.model_of("llama"), args=args)


REFUSED_LAYOUTS = {
    "unknown mode": (dict(size=4, mode="ring"),
                     r"mode='ring'\): mode must be one of \('ulysses', 'sequence', 'hybrid'\)"),
    "ulysses_size without hybrid": (dict(size=4, mode="sequence", ulysses_size=2),
                                    r"ulysses_size is the hybrid mode's Ulysses group; pass mode='hybrid'"),
    "hybrid without ulysses_size": (dict(size=4, mode="hybrid"), r"ulysses_size=None\): the hybrid mode needs"),
    "ulysses_size = size": (dict(size=4, mode="hybrid", ulysses_size=4), r"for heads alone use mode='ulysses'"),
    "ulysses_size not dividing": (dict(size=6, mode="hybrid", ulysses_size=4), r"that divides the size"),
    "state pass under Ulysses": (dict(size=4, state_pass="log"), r"Ulysses passes no state"),
    "unknown state pass": (dict(size=4, mode="sequence", state_pass="tree"),
                           r"state_pass must be one of \('auto', 'sequential', 'log'\)"),
}


@pytest.mark.parametrize("options, message", REFUSED_LAYOUTS.values(), ids=REFUSED_LAYOUTS.keys())
def test_a_mode_option_that_names_no_layout_is_refused_with_the_fix(options, message):
    """Refused when the class is made (before any launch), naming the option, what it needs and the fix."""
    from transformers import Trainer

    from compilepack.errors import ContextParallelError
    from compilepack.integrations import context_parallel

    with pytest.raises(ContextParallelError, match=message):
        context_parallel(Trainer, **options)


def test_the_modes_name_their_layout_on_the_class():
    from transformers import Trainer

    from compilepack.integrations import context_parallel
    from compilepack.integrations.context_parallel_trainer import Layout

    hybrid = context_parallel(Trainer, size=8, mode="hybrid", ulysses_size=2, state_pass="log")
    assert hybrid.context_parallel_layout == Layout(8, "hybrid", 2, "log")
    assert hybrid.context_parallel_size == 8 and "(hybrid) over groups of 8" in hybrid.__doc__
    assert context_parallel(Trainer, size=2).context_parallel_layout == Layout(2)


def test_a_model_that_reaches_training_unwrapped_is_refused_with_several_processes():
    """Each rank's gradient covers its slice only: without DDP / FSDP averaging them, every rank would step on its
    own, silently (seen with a PEFT policy when evaluate() ran before train()). One process needs no wrapper."""
    from compilepack.errors import ContextParallelError
    from compilepack.integrations.context_parallel_trainer import refuse_unsynchronised
    from torch.nn.parallel import DistributedDataParallel

    bare = torch.nn.Linear(2, 2)
    with pytest.raises(ContextParallelError, match="bare Linear, not wrapped by DDP.*call train\\(\\) first"):
        refuse_unsynchronised(bare, world_size=2)
    refuse_unsynchronised(bare, world_size=1)
    refuse_unsynchronised(DistributedDataParallel.__new__(DistributedDataParallel), world_size=2)  # its class only
