"""HF ``Trainer`` on a patched model, compiled (``torch_compile=True``, backend ``aot_eager``), 3 steps.

The first step's loss must equal the unpatched model's per-sample loss (each document alone, combined as the HF
loss combines a packed batch); all losses finite; no graph breaks. With the chunked LM head
(``patch(model, lm_head="chunked")``) and gradient accumulation (Trainer passes ``num_items_in_batch``), a compiled
run (fullgraph, dynamic) counts 1 graph, 0 breaks and no recompile, with every loss equal to the eager run's with
the stock head.
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


# Trainer's compile through accelerate with fullgraph and dynamic shapes: accelerate's documented variables (set by
# `accelerate launch --dynamo_use_fullgraph --dynamo_use_dynamic`); Trainer itself passes dynamic=None.
FULLGRAPH_DYNAMIC = {"ACCELERATE_DYNAMO_USE_FULLGRAPH": "1", "ACCELERATE_DYNAMO_USE_DYNAMIC": "1"}


def _losses(model, tmp_path, **overrides) -> list[float]:
    trainer = recording(Trainer)(
        model=model,
        args=training_args(tmp_path, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                           **overrides),
        train_dataset=[{"input_ids": s} for s in training_docs(model.config.vocab_size)],
        data_collator=hf_flattening(),
    )
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule) == args_compile(trainer)
    return trainer.recorded_losses


def args_compile(trainer) -> bool:
    return trainer.args.torch_compile


@pytest.mark.parametrize("family_name", ["llama", "qwen3_5"])
def test_trainer_compiled_chunked_head_one_graph_losses_equal_eager_stock_head(family_name, tmp_path, monkeypatch):
    """3 optimizer steps of 2 accumulated micro-batches (6 varied packed rows): the chunked head compiled with
    fullgraph and dynamic shapes is 1 graph, 0 breaks; each micro-batch's loss (Trainer's num_items_in_batch
    normalisation) equals the eager stock head's within 1e-5 (fp32; measured <= 9.5e-7)."""
    import os

    from accelerate.state import AcceleratorState

    torch.manual_seed(0)
    base = build_tiny(family_named(family_name))
    stock = compilepack.patch(copy.deepcopy(base))
    chunked = compilepack.patch(copy.deepcopy(base), lm_head="chunked")
    for key, value in FULLGRAPH_DYNAMIC.items():
        monkeypatch.setenv(key, value)
    compiled = _losses(chunked, tmp_path / "compiled")
    assert dynamo_counts() == (1, 0)
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    AcceleratorState._reset_state(reset_partial_state=True)
    eager = _losses(stock, tmp_path / "eager", torch_compile=False, torch_compile_backend=None)
    assert len(compiled) == len(eager) == 6
    assert max(abs(a - b) for a, b in zip(compiled, eager)) <= 1e-5, (compiled, eager)
