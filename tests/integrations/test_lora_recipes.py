"""TRL's LoRA recipe compiled (issue 42): PEFT + gradient checkpointing, whose ``enable_input_require_grads()`` hook
(``output.requires_grad_(True)`` on the input embeddings) dynamo cannot trace. A patched model runs that hook only
outside a compile (compilepack/integrations/peft.py): 0 breaks, gradients and losses equal to eager.

Every claim has its control: the stock hook left in place (``compilepack.integrations.peft.remove``) fails
``fullgraph=True`` or breaks the graph.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

import compilepack  # noqa: E402
from compilepack.integrations import peft as input_grads  # noqa: E402
from compilepack.patching import family_named  # noqa: E402
from tests.families import build_tiny  # noqa: E402
from tests.integrations.common import TRAINING_ARGS, dynamo_counts, recording, training_docs  # noqa: E402
from tests.integrations.test_peft import LORA_TARGETS, TOLERANCE  # noqa: E402
from tests.models import hf_batch, random_docs, relative_grad_error, summed_token_loss  # noqa: E402

LENGTHS = [70, 1, 23, 5, 40]
REENTRANT = {"non-reentrant": False, "reentrant": True}


def lora_model(family_name: str, *, reentrant: bool, patch: bool = True):
    """A LoRA model (attention and mixer projections) with transformers' gradient checkpointing, train mode."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family_name], init_lora_weights=False)
    model = get_peft_model(build_tiny(family_named(family_name)), config).train()
    if patch:
        compilepack.patch(model)
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def trainable_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def packed_grads(model, batch) -> dict[str, torch.Tensor]:
    summed_token_loss(model(**batch).logits, batch["labels"]).backward()
    return trainable_grads(model)


def embedding_hooks(model) -> list:
    return list(model.get_base_model().get_input_embeddings()._forward_hooks.values())


def is_stock_hook(hook) -> bool:
    """transformers' own ``make_inputs_require_grads`` (``PreTrainedModel.enable_input_require_grads``)."""
    return hook.__module__ == "transformers.modeling_utils" and hook.__qualname__.endswith(".make_inputs_require_grads")


def compilepack_hooks(model) -> list:
    """compilepack's input-grads hooks registered within ``model``."""
    hooks = (hook for module in model.modules() for hook in module._forward_hooks.values())
    return [hook for hook in hooks if hook is input_grads.requires_grad_outside_compile]


# ------------------------------------------------------------------------------------------------ the hook itself


def test_hook_is_per_instance_installed_as_enabled_and_undone_by_unpatch():
    """patch() swaps a hook already there for compilepack's, and a later gradient_checkpointing_enable registers
    compilepack's; an unpatched model keeps the stock hook; unpatch puts back the stock hook and the class's method;
    transformers' own disable_input_require_grads removes compilepack's hook."""
    patched = lora_model("llama", reentrant=False)
    other = lora_model("llama", reentrant=False, patch=False)
    assert embedding_hooks(patched) == [input_grads.requires_grad_outside_compile]
    assert [is_stock_hook(h) for h in embedding_hooks(other)] == [True]

    before_patch = lora_model("llama", reentrant=False, patch=False)  # hook first, patch second
    compilepack.patch(before_patch)
    assert embedding_hooks(before_patch) == [input_grads.requires_grad_outside_compile]
    before_patch.get_base_model().enable_input_require_grads()  # enabled twice: still one hook
    assert embedding_hooks(before_patch) == [input_grads.requires_grad_outside_compile]
    before_patch.get_base_model().disable_input_require_grads()
    assert embedding_hooks(before_patch) == []

    compilepack.unpatch(patched)
    assert [is_stock_hook(h) for h in embedding_hooks(patched)] == [True]
    assert not any("enable_input_require_grads" in m.__dict__ for m in patched.modules())


def test_hook_engages_without_peft():
    """transformers 5.25's gradient_checkpointing_enable enables the input grads of every input_ids model, PEFT or
    not. A patched plain model with frozen embeddings (their output requires no grad, as under LoRA) gets
    compilepack's hook: fullgraph=True compiles. The control: the stock hook fails fullgraph=True."""
    torch.manual_seed(0)
    model = compilepack.patch(build_tiny(family_named("llama"))).train()
    model.get_input_embeddings().requires_grad_(False)
    model.gradient_checkpointing_enable()
    assert list(model.get_input_embeddings()._forward_hooks.values()) == [input_grads.requires_grad_outside_compile]
    batch = hf_batch(random_docs(model.config.vocab_size, [30, 5, 20]))
    torch.compile(model, backend="eager", fullgraph=True, dynamic=True)(**batch)

    input_grads.remove(model)  # the control
    assert [is_stock_hook(h) for h in model.get_input_embeddings()._forward_hooks.values()] == [True]
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="requires_grad_"):
        torch.compile(model, backend="eager", fullgraph=True, dynamic=True)(**batch)


def test_hook_survives_deepcopy_and_keeps_the_copy_its_own():
    model = lora_model("llama", reentrant=False)
    copied = copy.deepcopy(model)
    method = copied.get_base_model().__dict__["enable_input_require_grads"]
    assert method.model is copied.get_base_model()
    assert compilepack_hooks(copied) and compilepack.is_patched(copied)
    copied.get_base_model().disable_input_require_grads()  # the copy's handles remove the copy's hook only
    assert not compilepack_hooks(copied) and compilepack_hooks(model)


@pytest.mark.parametrize("family_name", ["llama", "qwen3_5", "bamba"])
def test_eager_reentrant_checkpointing_still_gets_inputs_that_require_grad(family_name):
    """The hook's reason, kept: eager reentrant checkpointing gives every adapter a gradient, equal to the
    non-reentrant run's. The control: without the hook no checkpointed layer's output requires grad, so the loss
    does not either (the adapters are all inside those layers) and backward() has nothing to differentiate."""
    docs = random_docs(256, LENGTHS, seed=1)
    batch = hf_batch(docs)
    reference = packed_grads(lora_model(family_name, reentrant=False), batch)
    guarded = packed_grads(lora_model(family_name, reentrant=True), batch)
    assert guarded.keys() == reference.keys() and relative_grad_error(guarded, reference) <= TOLERANCE[family_name]

    control = lora_model(family_name, reentrant=True)
    control.get_base_model().disable_input_require_grads()
    with pytest.raises(RuntimeError, match="does not require grad"):
        packed_grads(control, batch)


# ------------------------------------------------------------------------------------------------ compiled


def _compiled_grads_equal_eager(family_name, reentrant):
    model = lora_model(family_name, reentrant=reentrant)
    batch = hf_batch(random_docs(model.config.vocab_size, LENGTHS, seed=1))
    eager = packed_grads(model, batch)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    summed_token_loss(compiled(**batch).logits, batch["labels"]).backward()
    assert dynamo_counts() == (1, 0)
    grads = trainable_grads(model)
    assert grads.keys() == eager.keys() and relative_grad_error(grads, eager) <= TOLERANCE[family_name]

    input_grads.remove(model)  # the control: the stock hook, traced
    with pytest.raises(torch._dynamo.exc.Unsupported, match="requires_grad_"):
        torch.compile(model, backend="eager", fullgraph=True, dynamic=True)(**batch)


@pytest.mark.slow  # 60-130 s on 2 shared cores
@pytest.mark.parametrize("checkpointing", REENTRANT)
def test_compiled_lora_checkpointing_one_graph_grads_equal_eager_llama(checkpointing):
    """fullgraph=True over LoRA + checkpointing (either kind): one graph; AOTAutograd's gradients == eager's with the
    stock hook. The control: the stock hook fails fullgraph=True."""
    _compiled_grads_equal_eager("llama", REENTRANT[checkpointing])


# The hybrids with reentrant checkpointing only: the guard's non-reentrant case is family-independent (the hook sits on
# the embeddings: llama above); the mixers compiled under non-reentrant checkpointing are test_peft.py's
# test_compiled_lora_with_checkpointing_qwen3_5 (grads against each document alone) and the SFTTrainer recipe below
# (TRL's default, every family).
@pytest.mark.slow
@pytest.mark.parametrize("family_name", ["qwen3_5", "bamba"])
def test_compiled_lora_reentrant_checkpointing_one_graph_grads_equal_eager_hybrids(family_name):
    _compiled_grads_equal_eager(family_name, reentrant=True)


# ------------------------------------------------------------------------------------------------ the trainers

# accelerate's documented variables for one compile with fullgraph (Trainer itself passes dynamic=None)
FULLGRAPH_DYNAMIC = {"ACCELERATE_DYNAMO_USE_FULLGRAPH": "1", "ACCELERATE_DYNAMO_USE_DYNAMIC": "1"}
# TRL's gradient_checkpointing_kwargs={"selective": True} is not here: with a peft_config, TRL 1.16 wraps the PEFT
# wrapper's gradient_checkpointing_enable after transformers already enabled checkpointing with the key in it, so the
# eager run fails in torch's checkpoint ("Unexpected keyword arguments: selective"), stock and patched alike.
CHECKPOINTING = {"default": None, "reentrant": {"use_reentrant": True}}
STEP_TOLERANCE = 1e-5  # fp32 losses, compiled vs the same recipe eager, every step


def lora_config(family_name: str) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family_name], init_lora_weights=False)


def sft_lora_trainer(family_name, tmp_path, *, checkpointing, compile_: bool, peft_config: LoraConfig | None = None):
    """TRL's LoRA recipe: SFTTrainer(patch(model), peft_config=...), padding-free, gradient checkpointing on
    (SFTConfig's default), 4 steps of 3 samples, fp32. ``peft_config``: :func:`lora_config` unless given."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from compilepack.integrations import with_boundaries
    from tests.integrations.test_trl import word_tokenizer

    torch.manual_seed(0)
    model = compilepack.patch(build_tiny(family_named(family_name)))
    settings = {**TRAINING_ARGS, "max_steps": 4, "per_device_train_batch_size": 3, "torch_compile": compile_}
    if not compile_:
        settings["torch_compile_backend"] = None  # a backend alone turns torch_compile back on
    args = SFTConfig(output_dir=str(tmp_path), padding_free=True, max_length=None, bf16=False,
                     gradient_checkpointing_kwargs=CHECKPOINTING[checkpointing], **settings)
    assert args.gradient_checkpointing  # TRL's default
    samples = training_docs(model.config.vocab_size)
    trainer = recording(SFTTrainer)(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": samples}),
                                    processing_class=word_tokenizer(model.config.vocab_size),
                                    peft_config=peft_config or lora_config(family_name))
    trainer.data_collator = with_boundaries(trainer.data_collator)
    return trainer


def eager_losses(make_trainer, monkeypatch) -> list[float]:
    """The same recipe uncompiled (accelerate's variables, set by the compiled run's arguments, cleared)."""
    import os

    from accelerate.state import AcceleratorState

    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer = make_trainer(compile_=False)
    trainer.train()
    return trainer.recorded_losses


def assert_one_graph_and_eager_losses(trainer, make_trainer, monkeypatch):
    trainer.train()
    assert dynamo_counts() == (1, 0)
    eager = eager_losses(make_trainer, monkeypatch)
    assert len(trainer.recorded_losses) == len(eager) == 4
    assert max(abs(a - b) for a, b in zip(trainer.recorded_losses, eager)) <= STEP_TOLERANCE


def _sft_lora_recipe(family_name, checkpointing, tmp_path, monkeypatch):
    for key, value in FULLGRAPH_DYNAMIC.items():
        monkeypatch.setenv(key, value)

    def make(compile_):
        return sft_lora_trainer(family_name, tmp_path, checkpointing=checkpointing, compile_=compile_)

    trainer = make(compile_=True)
    assert compilepack_hooks(trainer.model)  # TRL enabled the hook: compilepack's
    assert_one_graph_and_eager_losses(trainer, make, monkeypatch)


@pytest.mark.slow  # 13-22 s each on 2 shared cores (2026-12-05), the eager run included
@pytest.mark.parametrize("family_name", ["llama", "qwen3_5", "bamba"])
def test_sft_trainer_lora_recipe_default_compiles_one_graph(family_name, tmp_path, monkeypatch):
    """SFTTrainer(peft_config=LoraConfig(...)), TRL's defaults (non-reentrant checkpointing on transformers 5),
    torch_compile=True with accelerate's fullgraph + dynamic: 1 graph, 0 breaks over 4 varied packed steps, every
    loss == the same recipe eager."""
    _sft_lora_recipe(family_name, "default", tmp_path, monkeypatch)


# Reentrant checkpointing through the trainer on llama only: what the trainer adds (TRL enabling the input-grads
# hook, which patch() guards) does not depend on the family; each hybrid's compiled grads under reentrant
# checkpointing are test_compiled_lora_reentrant_checkpointing_one_graph_grads_equal_eager_hybrids above.
@pytest.mark.slow
def test_sft_trainer_lora_recipe_reentrant_compiles_one_graph_llama(tmp_path, monkeypatch):
    _sft_lora_recipe("llama", "reentrant", tmp_path, monkeypatch)


def test_sft_trainer_lora_recipe_control_stock_hook_fails_fullgraph(tmp_path, monkeypatch):
    """The control: the same recipe with the stock hook (the guard removed) fails accelerate's fullgraph compile."""
    for key, value in FULLGRAPH_DYNAMIC.items():
        monkeypatch.setenv(key, value)
    trainer = sft_lora_trainer("llama", tmp_path, checkpointing="default", compile_=True)
    input_grads.remove(trainer.model)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="requires_grad_"):
        trainer.train()


@pytest.mark.slow
@pytest.mark.parametrize("family_name", ["llama"])  # the hook is the subject; the mixers: the SFTTrainer tests above
def test_hf_trainer_peft_model_with_checkpointing_compiles_one_graph(family_name, tmp_path, monkeypatch):
    """HF Trainer, get_peft_model(patch(model)), gradient_checkpointing=True: Trainer's gradient_checkpointing_enable
    adds the hook (through the patched model's guarded method): 1 graph, 0 breaks, losses == eager."""
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    for key, value in FULLGRAPH_DYNAMIC.items():
        monkeypatch.setenv(key, value)

    def make(compile_: bool):
        torch.manual_seed(0)
        model = get_peft_model(compilepack.patch(build_tiny(family_named(family_name))), lora_config(family_name))
        settings = {**TRAINING_ARGS, "max_steps": 4, "per_device_train_batch_size": 3, "torch_compile": compile_}
        if not compile_:
            settings["torch_compile_backend"] = None
        args = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, **settings)
        collate = compilepack.checked(DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True))
        samples = training_docs(model.config.vocab_size)
        return recording(Trainer)(model=model, args=args, data_collator=collate,
                                  train_dataset=Dataset.from_dict({"input_ids": samples}))

    trainer = make(compile_=True)
    assert_one_graph_and_eager_losses(trainer, make, monkeypatch)
    assert compilepack_hooks(trainer.model)
