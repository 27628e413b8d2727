"""The trainers' context-parallel modes: ``context_parallel(SFTTrainer or Trainer, size=4, mode="sequence")`` and
``mode="hybrid", ulysses_size=2`` (Ulysses in pairs, sequence across the two pairs), under torchrun on 4 gloo
processes, against one process; with the chunked LM head and with gradient checkpointing.

The configs have fewer heads than ranks (``FEW_HEADS``: 2 query heads, 1 kv head; one or two heads for the linear
mixers), which Ulysses at W = 4 refuses. One launch of 4 processes (``cp_trainer_worker.py``, ``--cp 4``); the
single-process references are the same trainer classes, unpatched for context parallelism. SGD without clipping,
tolerances and reference as test_context_parallel_trainer.py.

In the cp8 stage (4 processes on 2 cores): ``COMPILEPACK_CP8=1 python -m pytest -q -p no:cacheprovider -m cp8
tests/distributed``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("trl", reason="TRL is an optional test dependency: pip install 'trl>=1.16'")

from tests.integrations import cp_trainer_worker as worker  # noqa: E402
from tests.integrations.test_context_parallel_trainer import (  # noqa: E402
    LOSS_TOLERANCE, WEIGHT_TOLERANCE, _launch, loss_error, weight_error)

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.skipif(os.environ.get("COMPILEPACK_CP8") != "1",
                       reason="the cp8 stage: COMPILEPACK_CP8=1 python -m pytest -m cp8 tests/distributed"),
    pytest.mark.cp8, pytest.mark.slow, pytest.mark.multiprocess,
]

RUNS = ["run:sft:qwen3_5:sequence", "run:hf:bamba:sequence", "run:sft:bamba:hybrid", "run:hf:qwen3_5:hybrid"]
WITH = ["chunked:hf:bamba:sequence", "chunked:hf:qwen3_5:hybrid", "checkpointing:sft:qwen3_5:sequence",
        "checkpointing:hf:bamba:hybrid"]
CONTROLS = ["control-no-pass:sft:qwen3_5:sequence", "control-no-pass:hf:bamba:hybrid"]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _launch(tmp_path_factory, 4, RUNS + WITH + CONTROLS, cp=4)


@functools.cache
def reference(kind: str, family_name: str, path: str) -> dict:
    """One process, the same few-heads config and documents, the per-device batch (dp = 1)."""
    trainer = worker.trainer_for(kind, family_name, Path(path) / f"few-{kind}-{family_name}", cp=None,
                                 batch=worker.PER_DEVICE_BATCH, heads="few")
    trainer.train()
    return {"losses": worker.losses(trainer), "weights": worker.weights(trainer.model)}


def _reference_of(case: str, tmp_path_factory) -> dict:
    _, kind, family_name, _ = case.split(":")
    return reference(kind, family_name, str(tmp_path_factory.getbasetemp()))


@pytest.mark.parametrize("case", RUNS + WITH)
def test_sequence_and_hybrid_modes_train_as_one_process(world4, case, tmp_path_factory):
    """Every logged loss and the final weights; with the chunked LM head (kept when the trainer re-patches) and with
    gradient checkpointing (the layers' collectives run again in the backward) against the plain one-process run."""
    want, got = _reference_of(case, tmp_path_factory), world4[case]
    assert loss_error(got["losses"], want["losses"]) <= LOSS_TOLERANCE, (got["losses"], want["losses"])
    assert weight_error(got["weights"], want["weights"]) <= WEIGHT_TOLERANCE
    assert got.get("chunked_head", True)


# The state pass and the halo skipped: at these tiny models' initialisation the states carry little (measured 4.5e-3
# for Qwen3.5 in the sequence mode), so the control must miss by 100 x the weights' tolerance, as the sequence-mode
# tests ask of theirs (tests/distributed/test_sequence_parallel.py).
MODE_CONTROL_MISS = 100 * WEIGHT_TOLERANCE


@pytest.mark.parametrize("case", CONTROLS)
def test_control_without_the_state_pass_and_halo_misses_by_far(world4, case, tmp_path_factory):
    want, got = _reference_of(case, tmp_path_factory), world4[case]
    assert weight_error(got["weights"], want["weights"]) >= MODE_CONTROL_MISS
