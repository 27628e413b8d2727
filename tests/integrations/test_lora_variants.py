"""The recipes users pair with LoRA and packing (issue 42), compiled and exact against eager, on Llama, Qwen3.5 and
Bamba. Every LoRA here targets the linear mixers' projections as well as attention (``LORA_TARGETS``).

- ``modules_to_save`` (the LM head trained in full beside the adapters), through TRL's SFTTrainer recipe;
- a merged-and-unloaded model (``merge_and_unload()`` of a patched LoRA model), trained on through HF Trainer;
- DoRA: PEFT's own DoRA forward breaks the graph, stock and patched alike; the breaks are counted and located in
  PEFT's code, and the packed gradients stay equal to eager.

The controls: the stock input-grad hook left in place fails ``fullgraph=True`` (the PEFT recipes), and the merged
model unpatched mixes the packed documents (its logits miss each document's own by far).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.utils import ModulesToSaveWrapper  # noqa: E402

import compilepack  # noqa: E402
from compilepack.integrations import peft as input_grads  # noqa: E402
from compilepack.patching import family_named  # noqa: E402
from tests.families import build_tiny  # noqa: E402
from tests.integrations.common import TRAINING_ARGS, dynamo_counts, recording, training_docs  # noqa: E402
from tests.integrations.test_lora_recipes import (  # noqa: E402
    FULLGRAPH_DYNAMIC,
    assert_one_graph_and_eager_losses,
    packed_grads,
    sft_lora_trainer,
    trainable_grads,
)
from tests.integrations.test_peft import LORA_TARGETS, TOLERANCE  # noqa: E402
from tests.models import hf_batch, random_docs, relative_grad_error, summed_token_loss  # noqa: E402

FAMILIES = ["llama", "qwen3_5", "bamba"]
LENGTHS = [70, 1, 23, 5, 40]
LOGITS_TOLERANCE = 1e-4  # fp32, packed vs each document alone; a packed row run as one sequence misses it by >1e-2


def lora(family_name: str, **options) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family_name], init_lora_weights=False, **options)


def lora_model(family_name: str, **options):
    """A patched LoRA model (adapters initialised non-zero, so that they change the output), train mode."""
    torch.manual_seed(0)
    model = get_peft_model(build_tiny(family_named(family_name)), lora(family_name, **options))
    return compilepack.patch(model).train()


def set_fullgraph_dynamic(monkeypatch):
    for key, value in FULLGRAPH_DYNAMIC.items():
        monkeypatch.setenv(key, value)


# ------------------------------------------------------------------------------------------------ model level, fast


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("recipe", ["modules_to_save", "merged"])
def test_recipe_with_checkpointing_traces_to_one_graph(family_name, recipe):
    """fullgraph=True over the recipe's model with non-reentrant checkpointing, as a trainer compiles it (counted,
    no code generated): 1 graph. The PEFT model's control: the stock hook fails fullgraph."""
    model = lora_model(family_name, **({"modules_to_save": ["lm_head"]} if recipe == "modules_to_save" else {}))
    if recipe == "merged":
        model = model.merge_and_unload()
    model.gradient_checkpointing_enable()
    batch = hf_batch(random_docs(model.config.vocab_size, LENGTHS, seed=1))
    explained = torch._dynamo.explain(model)(**batch)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    if recipe == "modules_to_save":
        input_grads.remove(model)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="requires_grad_"):
            torch.compile(model, backend="eager", fullgraph=True, dynamic=True)(**batch)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_merged_and_unloaded_model_is_patched_and_exact(family_name):
    """merge_and_unload() of a patched LoRA model: still patched, no PEFT layer left, and its packed logits equal each
    document run alone through the unmerged LoRA model (adapters non-zero, so the merge is seen). The control: the
    merged model unpatched runs the packed row as one sequence and misses by far."""
    from peft.tuners.lora import LoraLayer

    peft_model = lora_model(family_name).eval()
    docs = random_docs(peft_model.config.vocab_size, LENGTHS, seed=2)
    with torch.no_grad():
        alone = torch.cat([peft_model(input_ids=torch.tensor([doc])).logits[0] for doc in docs])
        merged = copy.deepcopy(peft_model).merge_and_unload()
        assert compilepack.is_patched(merged) and not any(isinstance(m, LoraLayer) for m in merged.modules())
        batch = hf_batch(docs)
        batch.pop("labels")
        packed = merged(**batch).logits[0]
        assert (packed - alone).abs().max().item() <= LOGITS_TOLERANCE
        compilepack.unpatch(merged)
        mixed = merged(input_ids=batch["input_ids"], position_ids=torch.arange(len(alone))[None]).logits[0]
        assert (mixed - alone).abs().max().item() > 100 * LOGITS_TOLERANCE


# ------------------------------------------------------------------------------------------------ through the trainers


# Through the trainers on llama and bamba (modules_to_save) and llama (merged): each family's model traces to one graph
# in both recipes above (test_recipe_with_checkpointing_traces_to_one_graph); what the trainer adds does not depend on
# the family, and qwen3_5's trainer run (the slowest, ~25 s) is test_lora_recipes' SFTTrainer recipe.
@pytest.mark.slow  # 15-25 s each on 2 shared cores (the eager run included)
@pytest.mark.parametrize("family_name", ["llama", "bamba"])
def test_sft_trainer_lora_with_modules_to_save_one_graph_losses_equal_eager(family_name, tmp_path, monkeypatch):
    """SFTTrainer(peft_config=LoraConfig(..., modules_to_save=["lm_head"])), TRL's defaults (checkpointing on),
    torch_compile=True with accelerate's fullgraph + dynamic: 1 graph, 0 breaks over 4 varied packed steps, every
    loss == the same recipe eager, and the saved LM head trained. Its control (the stock hook fails fullgraph) is
    test_recipe_with_checkpointing_traces_to_one_graph's, on the same model, and test_lora_recipes' on this trainer."""
    set_fullgraph_dynamic(monkeypatch)
    config = lora(family_name, modules_to_save=["lm_head"])

    def make(compile_: bool):
        return sft_lora_trainer(family_name, tmp_path, checkpointing="default", compile_=compile_, peft_config=config)

    trainer = make(compile_=True)
    head = trainer.model.get_base_model().lm_head
    assert isinstance(head, ModulesToSaveWrapper)
    assert_one_graph_and_eager_losses(trainer, make, monkeypatch)
    assert not torch.equal(head.modules_to_save["default"].weight, head.original_module.weight)  # it trained


def hf_trainer(model, tmp_path, *, compile_: bool):
    """HF Trainer on ``model`` with the HF flattening collator (checked), gradient checkpointing on, 4 steps of 3."""
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    settings = {**TRAINING_ARGS, "max_steps": 4, "per_device_train_batch_size": 3, "torch_compile": compile_}
    if not compile_:
        settings["torch_compile_backend"] = None  # a backend alone turns torch_compile back on
    args = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, **settings)
    collate = compilepack.checked(DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True))
    samples = training_docs(model.config.vocab_size)
    return recording(Trainer)(model=model, args=args, data_collator=collate,
                              train_dataset=Dataset.from_dict({"input_ids": samples}))


@pytest.mark.slow
@pytest.mark.parametrize("family_name", ["llama"])
def test_hf_trainer_on_merged_and_unloaded_model_one_graph_losses_equal_eager(family_name, tmp_path, monkeypatch):
    """The model after LoRA: merge_and_unload() of the patched PEFT model, then full fine-tuning with HF Trainer
    (gradient checkpointing, torch_compile=True, fullgraph + dynamic): 1 graph, 0 breaks, losses == eager."""
    set_fullgraph_dynamic(monkeypatch)
    merged = lora_model(family_name).merge_and_unload()
    merged.requires_grad_(True)  # get_peft_model froze the base weights; merging leaves them frozen
    make = lambda compile_: hf_trainer(copy.deepcopy(merged), tmp_path, compile_=compile_)  # noqa: E731
    assert_one_graph_and_eager_losses(make(compile_=True), make, monkeypatch)


# ------------------------------------------------------------------------------------------------ DoRA


def _break_files(model, batch) -> tuple[int, int, set[str]]:
    """(graphs, breaks, the package of each break's innermost frame)."""
    explained = torch._dynamo.explain(model)(**batch)
    packages = {b.user_stack[-1].filename.split("site-packages/")[-1].split("/")[0] for b in explained.break_reasons}
    return explained.graph_count, explained.graph_break_count, packages


@pytest.mark.parametrize("checkpointing", [pytest.param(False, marks=pytest.mark.slow), True])  # 21 s / 8 s
def test_dora_breaks_in_peft_code_stock_and_patched_alike(checkpointing):
    """PEFT's DoRA does not compile to one graph (its weight-norm path calls ``dequantize_module_weight``, which
    dynamo cannot trace; under checkpointing its cache clearing is a side effect dynamo refuses): every break lies in
    PEFT's code, and the unpatched model breaks as often on the same packed row (llama: stock takes packed
    position_ids)."""
    batch = hf_batch(random_docs(256, LENGTHS, seed=1))
    counts = {}
    for patched in (True, False):
        model = lora_model("llama", use_dora=True)
        if not patched:
            compilepack.unpatch(model)
        if checkpointing:
            model.get_base_model().gradient_checkpointing_enable()
        inputs = batch if patched else {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        counts[patched] = _break_files(model, inputs)
    graphs, breaks, packages = counts[True]
    assert breaks > 0 and packages == {"peft"}, counts
    assert counts[True][:2] == counts[False][:2], counts


@pytest.mark.slow  # 28-30 s each: dozens of graphs (qwen3_5: 55 s, and DoRA's breaks are PEFT's, not the mixers')
@pytest.mark.parametrize("family_name", ["llama", "bamba"])
def test_dora_compiled_grads_equal_eager(family_name):
    """DoRA compiled as a trainer would without fullgraph (its breaks split the graph): LoRA and magnitude
    gradients equal eager's on a packed batch."""
    model = lora_model(family_name, use_dora=True)
    batch = hf_batch(random_docs(model.config.vocab_size, LENGTHS, seed=1))
    eager = packed_grads(model, batch)
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    summed_token_loss(compiled(**batch).logits, batch["labels"]).backward()
    grads = trainable_grads(model)
    assert any("lora_magnitude_vector" in name for name in grads)
    assert grads.keys() == eager.keys() and relative_grad_error(grads, eager) <= TOLERANCE[family_name]
    assert dynamo_counts()[1] > 0  # it did break: PEFT's code, as above
