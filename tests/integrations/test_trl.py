"""TRL ``SFTTrainer`` with ``padding_free=True`` on a patched, compiled model (optional: skipped without trl).

TRL's padding-free collator (1.16) emits the HF boundary kwargs itself (``cu_seq_lens_q/k``, ``max_length_q/k``,
``seq_idx``, ``position_ids``); it is wrapped in ``with_boundaries`` anyway, which validates every batch and
adds the kwargs for TRL versions or collators that emit ``position_ids`` only.

SFTTrainer always installs TRL's fused LM head; compilepack puts its own forward in its place, scored by its own op
(compilepack/integrations/trl.py), whichever comes first, the head or the patch, or through
``with_routed_head(SFTTrainer)``. Compiled SFTTrainer runs then count 1 graph, 0 breaks and no recompile
over varied packed batches, with losses equal to the eager run's with TRL's own head; the same head left unrouted
breaks the graph twice (the control).
"""

from __future__ import annotations

import copy
import importlib
import inspect

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is an optional test dependency: pip install -e '.[test]'")
from packaging.version import Version  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

import compilepack  # noqa: E402
from compilepack.batch.keys import BOUNDARY_KEYS  # noqa: E402
from compilepack.integrations import with_boundaries  # noqa: E402
from compilepack.patching import family_named  # noqa: E402
from tests.families import build_tiny  # noqa: E402
from compilepack.integrations.trl import RoutedFusedHead, is_trl_head, unroute_all, with_routed_head  # noqa: E402
from tests.integrations.common import (  # noqa: E402
    LOSS_TOLERANCE,
    TRAINING_ARGS,
    assert_first_step_equals_per_sample_loss,
    dynamo_counts,
    per_sample_loss,
    recording,
    training_docs,
)
from tests.models import build_pair  # noqa: E402

# TRL 1.15 on: SFTTrainer adds its fused LM head (routed by compilepack from 1.16). TRL 1.5 to 1.14: with
# loss_type="chunked_nll" (1.14's default) it installs its chunked cross-entropy head instead, routed too. The same
# tests run on both (CI's oldest-admitted stage); the tests of add_fused_lm_head itself are skipped without it.
HAS_FUSED_HEAD = hasattr(importlib.import_module("trl.trainer.utils"), "add_fused_lm_head")
needs_head = pytest.mark.skipif(not HAS_FUSED_HEAD, reason=f"TRL {trl.__version__} has no fused LM head")


def adds_a_head(args) -> bool:
    """Whether SFTTrainer with these arguments installs a TRL LM head on the model (which compilepack routes)."""
    return HAS_FUSED_HEAD or getattr(args, "loss_type", None) == "chunked_nll"


def word_tokenizer(vocab_size: int = 256):
    """A word-level tokenizer built in code ("t0".."t255"): SFTTrainer needs a processing class, nothing downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", unk_token="t1", eos_token="t2")


@pytest.mark.slow  # 48 s on 2 shared cores (issue 41); CI runs it in the slow stage
def test_sft_trainer_padding_free_compiled_first_step_equals_per_sample_loss(tmp_path):
    """Trainer's own compile (``dynamic=None``): one static graph, then one dynamic one, no break."""
    from datasets import Dataset

    torch.manual_seed(0)
    model = build_tiny(family_named("llama"))
    stock = copy.deepcopy(model).eval()
    samples = training_docs(model.config.vocab_size)
    args = SFTConfig(
        output_dir=str(tmp_path),
        padding_free=True,
        max_length=None,  # padding-free without packing: samples are used whole
        bf16=False,  # SFTConfig turns bf16 autocast on by default; see test_known_issues.py
        **TRAINING_ARGS,
    )
    trainer = recording(SFTTrainer)(
        model=compilepack.patch(model),
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": samples}),
        processing_class=word_tokenizer(model.config.vocab_size),
    )
    # SFTTrainer refuses a custom collator with padding_free=True, so its own is wrapped after construction
    assert isinstance(trainer.data_collator, DataCollatorForLanguageModeling) and trainer.data_collator.padding_free
    trainer.data_collator = with_boundaries(trainer.data_collator)
    trainer.train()

    first = assert_first_step_equals_per_sample_loss(trainer, stock, samples)
    assert "attention_mask" not in first
    assert isinstance(trainer.model.__dict__.get("forward"), RoutedFusedHead) == adds_a_head(args)
    graphs, breaks = dynamo_counts()
    assert breaks == 0 and graphs <= 2, (graphs, breaks)


@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
@pytest.mark.parametrize("packed_rows", [False, True], ids=["samples", "bfd-packed-rows"])
def test_trl_padding_free_collator_emits_valid_boundaries(pad_to_multiple_of, packed_rows):
    """What TRL's collator emits, checked key by key; a patched model's loss on it equals the per-sample loss."""
    stock, patched = build_pair(family_named("llama"))
    samples = training_docs(stock.config.vocab_size)[:6]
    if packed_rows:  # what SFTTrainer(packing=True, packing_strategy="bfd") feeds it: rows with seq_lengths
        features = [
            {"input_ids": samples[0] + samples[1], "seq_lengths": [len(samples[0]), len(samples[1])]},
            {"input_ids": [t for s in samples[2:] for t in s], "seq_lengths": [len(s) for s in samples[2:]]},
        ]
    else:
        features = [{"input_ids": s} for s in samples]
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=pad_to_multiple_of)
    batch = collate(features)

    if Version(trl.__version__) >= Version("1.16"):
        assert set(BOUNDARY_KEYS) <= set(batch), sorted(batch)
    batch = with_boundaries(lambda _: batch)(features)  # validates; adds the kwargs if this TRL lacks them
    boundaries = compilepack.validate(batch)
    total = sum(len(s) for s in samples)
    # TRL pads with position 0, so each padding token is a one-token document with label -100
    padding = [1] * (batch["input_ids"].shape[1] - total)
    assert boundaries.lengths == [len(s) for s in samples] + padding
    assert batch["max_length_q"] == max(len(s) for s in samples)
    with torch.no_grad():
        packed_loss = patched(**batch).loss.item()
    assert abs(packed_loss - per_sample_loss(stock, batch)[0]) <= LOSS_TOLERANCE


# ------------------------------------------------------------------------------------------------ compiled SFTTrainer

# SFTTrainer's compile through accelerate with fullgraph and dynamic shapes (accelerate's documented variables, which
# `accelerate launch --dynamo_use_fullgraph --dynamo_use_dynamic` sets): Trainer itself passes dynamic=None.
FULLGRAPH_DYNAMIC = {"ACCELERATE_DYNAMO_USE_FULLGRAPH": "1", "ACCELERATE_DYNAMO_USE_DYNAMIC": "1"}
STEPS = 4  # batches of 3 samples: 4 packed rows of different lengths and document counts
# fp32 losses of the compiled routed run against the eager run with TRL's own head, every step (measured: qwen3_5
# <= 9.5e-7, bamba equal)
STEP_TOLERANCE = 1e-5


def sft_trainer(model, tmp_path, *, compile_: bool, bf16: bool = False, trainer_class=SFTTrainer):
    from datasets import Dataset

    samples = training_docs(model.config.vocab_size)
    settings = {**TRAINING_ARGS, "max_steps": STEPS, "per_device_train_batch_size": 3, "torch_compile": compile_}
    if not compile_:
        settings["torch_compile_backend"] = None  # a backend alone turns torch_compile back on
    args = SFTConfig(output_dir=str(tmp_path), padding_free=True, max_length=None, bf16=bf16, **settings)
    trainer = recording(trainer_class)(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": samples}),
                                    processing_class=word_tokenizer(model.config.vocab_size))
    trainer.data_collator = with_boundaries(trainer.data_collator)
    return trainer


def eager_losses_with_trls_own_head(model, tmp_path, monkeypatch, bf16: bool = False) -> list[float]:
    """The same run uncompiled, with TRL's own head (unrouted): the reference of the compiled runs."""
    import os

    from accelerate.state import AcceleratorState

    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:  # the compiled run's TrainingArguments set them
        monkeypatch.delenv(key)
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer = sft_trainer(model, tmp_path / "eager", compile_=False, bf16=bf16)
    assert unroute_all(trainer.model) == adds_a_head(trainer.args)
    assert is_trl_head(trainer.model.__dict__.get("forward")) == adds_a_head(trainer.args)
    trainer.train()
    return trainer.recorded_losses


# qwen3_5 and bamba: 48-71 s each on 2 shared cores (issue 41: the README's command under 10 minutes): slow
@pytest.mark.parametrize("family_name, bf16", [
    pytest.param("llama", True, id="llama-bf16"),
    pytest.param("qwen3_5", False, id="qwen3_5-fp32", marks=pytest.mark.slow),
    pytest.param("bamba", False, id="bamba-fp32", marks=pytest.mark.slow),
])
def test_sft_trainer_compiled_one_graph_no_break_no_recompile(family_name, bf16, tmp_path, monkeypatch):
    """Patch, then SFTTrainer (its head is routed as TRL adds it), torch_compile=True with fullgraph and dynamic
    shapes: 4 steps of varied packed rows compile 1 graph (forward, loss and backward), 0 breaks. Losses against the
    eager run with TRL's own head: fp32, every step within 1e-5 (measured <= 9.5e-7); bf16 autocast (SFTConfig's
    default), the first step (same weights) within 1e-6 (measured: equal), later ones within the bf16 rounding of
    the updates (measured <= 2.3e-4)."""
    for key, value in FULLGRAPH_DYNAMIC.items():
        monkeypatch.setenv(key, value)
    torch.manual_seed(0)
    model = compilepack.patch(build_tiny(family_named(family_name)))
    reference_model = copy.deepcopy(model)
    trainer = sft_trainer(model, tmp_path, compile_=True, bf16=bf16)
    assert isinstance(trainer.model.__dict__.get("forward"), RoutedFusedHead) == adds_a_head(trainer.args)
    trainer.train()
    assert dynamo_counts() == (1, 0)
    eager = eager_losses_with_trls_own_head(reference_model, tmp_path, monkeypatch, bf16=bf16)
    compiled = trainer.recorded_losses
    assert len(compiled) == STEPS
    assert abs(compiled[0] - eager[0]) <= 1e-6
    assert max(abs(a - b) for a, b in zip(compiled, eager)) <= (5e-3 if bf16 else STEP_TOLERANCE)


def test_sft_trainer_given_a_model_compiled_by_the_recipe(tmp_path):
    """torch.compile(patch(model), fullgraph=True, dynamic=True) handed to SFTTrainer: TRL puts its head on the
    compiled wrapper, whose forward would then bypass the compiled code; compilepack moves the head into the model
    the compiled code calls, routed: 1 graph, 0 breaks over the run."""
    if not HAS_FUSED_HEAD and hasattr(importlib.import_module("trl.trainer.sft_trainer"), "_patch_chunked_ce_lm_head"):
        pytest.skip(f"TRL {trl.__version__}'s chunked_nll head cannot be added to a compiled model: TRL's own "
                    "_patch_chunked_ce_lm_head reads original_forward.__func__ (AttributeError, compilepack or not)")
    torch.manual_seed(0)
    model = compilepack.patch(build_tiny(family_named("llama")))
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    trainer = sft_trainer(compiled, tmp_path, compile_=False)
    assert trainer.model is compiled and "forward" in compiled.__dict__  # the compiled forward is back
    assert isinstance(model.__dict__.get("forward"), RoutedFusedHead) == adds_a_head(trainer.args)
    trainer.train()
    assert dynamo_counts() == (1, 0) and len(trainer.recorded_losses) == STEPS


@needs_head
def test_head_added_before_patch_is_routed_and_unpatch_restores_it():
    """The other order: TRL's head first, then patch routes it. The control: the same head unrouted (after unpatch,
    and repatched without routing) breaks the graph twice."""
    from trl.trainer.utils import add_fused_lm_head

    from tests.models import hf_batch, random_docs

    torch.manual_seed(0)
    model = build_tiny(family_named("llama")).train()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy", "is_top1"))  # TRL's options, read
    trl_head = model.__dict__["forward"]
    batch = {**hf_batch(random_docs(model.config.vocab_size, [30, 5, 20])), "fused_lm_head": True}
    compilepack.patch(model)
    routed = model.__dict__["forward"]
    assert isinstance(routed, RoutedFusedHead) and routed.trl_forward is trl_head
    assert inspect.signature(model.forward) == inspect.signature(trl_head)
    report = compilepack.explain(model, batch, backward=True)
    assert (report.graphs, report.graph_breaks) == (1, 0), report
    with torch.no_grad():
        ours = model(**batch)
        model.forward = trl_head  # TRL's own kernel on the same patched model
        theirs = model(**batch)
    assert abs(ours.loss.item() - theirs.loss.item()) <= 1e-6
    assert torch.equal(ours.is_top1, theirs.is_top1) and (ours.entropy - theirs.entropy).abs().max() <= 1e-5
    report = compilepack.explain(model, batch, backward=True)  # the control: TRL's head, not routed
    assert report.graph_breaks == 2 and "non-contiguous `out=`" in report.break_reasons[0], report
    model.forward = routed
    with pytest.raises(compilepack.CompilepackError, match="TRL's head is a closure over the original model"):
        copy.deepcopy(model)
    compilepack.unpatch(model)
    assert model.__dict__["forward"] is trl_head and not compilepack.is_patched(model)


@needs_head
def test_with_routed_head_routes_the_head_without_the_wrap(tmp_path, monkeypatch):
    """The explicit road, ``with_routed_head(SFTTrainer)``: its ``__init__`` routes the head TRL added, with TRL's
    adder as TRL made it (what ``patch()`` before ``import trl`` leaves: nothing wraps it then). 1 graph, 0 breaks.
    The control: SFTTrainer itself then keeps TRL's head, which breaks the graph twice."""
    import trl.trainer.sft_trainer as sft

    torch.manual_seed(0)
    model = compilepack.patch(build_tiny(family_named("llama")))
    control = compilepack.patch(copy.deepcopy(model))
    # patch() wrapped TRL's adder (TRL was imported): undone, as if TRL had been imported after patch()
    monkeypatch.setattr(sft, "add_fused_lm_head", sft.add_fused_lm_head.__compilepack_original__)
    trainer = sft_trainer(model, tmp_path, compile_=False, trainer_class=with_routed_head(SFTTrainer))
    assert isinstance(model.__dict__.get("forward"), RoutedFusedHead)
    batch = {**next(iter(trainer.get_train_dataloader())), "fused_lm_head": True}
    report = compilepack.explain(model, batch, backward=True)
    assert (report.graphs, report.graph_breaks) == (1, 0), report

    sft_trainer(control, tmp_path / "control", compile_=False)
    assert is_trl_head(control.__dict__.get("forward"))
    assert compilepack.explain(control, batch, backward=True).graph_breaks == 2
