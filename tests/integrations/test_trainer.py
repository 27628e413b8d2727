"""HF ``Trainer`` on a patched model, compiled (``torch_compile=True``, backend ``aot_eager``), 3 steps.

The first step's loss must equal the unpatched model's per-sample loss (each document alone, combined as the HF
loss combines a packed batch); all losses finite; no graph breaks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

import compilepack
from compilepack.patching import family_named
from tests.families import build_tiny
from tests.integrations.common import (
    TRAINING_ARGS,
    assert_first_step_equals_per_sample_loss,
    dynamo_counts,
    recording,
    training_docs,
)


def hf_flattening():
    # checked(): every batch is validated on the host before it reaches the compiled model
    return compilepack.checked(DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True))


def packed_fixed_shape():
    # 4 samples of <= 70 tokens always fit 2 rows of 160; identical shapes every step: one compile
    return compilepack.PackedCollator(160, fixed_shape=True, rows=2, max_docs=16)


def training_args(tmp_path, **overrides) -> TrainingArguments:
    return TrainingArguments(**{"output_dir": str(tmp_path), **TRAINING_ARGS, **overrides})


# Graphs: HF batches change length every step, so Trainer's torch.compile (dynamic=None) compiles once static,
# then once dynamic (the third batch, 60 tokens, fits one 64-token mixer chunk: it must not recompile again);
# fixed shapes compile once.
CASES = [
    pytest.param("llama", hf_flattening, 2, id="llama-DataCollatorWithFlattening"),
    pytest.param("llama", packed_fixed_shape, 1, id="llama-PackedCollator-fixed"),
    pytest.param("qwen3_5", hf_flattening, 2, id="qwen3_5-DataCollatorWithFlattening"),
    pytest.param("bamba", packed_fixed_shape, 1, id="bamba-PackedCollator-fixed"),
]


@pytest.mark.parametrize("family_name, make_collator, max_graphs", CASES)
def test_trainer_compiled_first_step_equals_per_sample_loss(tmp_path, family_name, make_collator, max_graphs):
    torch.manual_seed(0)
    model = build_tiny(family_named(family_name))
    stock = copy.deepcopy(model).eval()
    samples = training_docs(model.config.vocab_size)
    trainer = recording(Trainer)(
        model=compilepack.patch(model),
        args=training_args(tmp_path),
        train_dataset=[{"input_ids": s} for s in samples],
        data_collator=make_collator(),
    )
    trainer.train()

    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert_first_step_equals_per_sample_loss(trainer, stock, samples)
    graphs, breaks = dynamo_counts()
    assert breaks == 0 and 1 <= graphs <= max_graphs, (graphs, breaks)
