"""PEFT LoRA on the attention and mixer projections of a patched model, with gradient checkpointing on.

Packed LoRA gradients must equal the sum over documents run alone through the unpatched LoRA model, and every
recomputed mixing layer must receive the boundaries again in the backward pass.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

import compilepack  # noqa: E402
from compilepack.patching import family_named  # noqa: E402
from tests.families import build_tiny
from tests.models import (  # noqa: E402
    hf_batch,
    logits_alone,
    max_diff_packed_vs_alone,
    random_docs,
    relative_grad_error,
    summed_token_loss,
)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_TARGETS = {
    "llama": ATTENTION,
    "qwen3_5": [*ATTENTION, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],  # Gated DeltaNet
    "bamba": [*ATTENTION, "in_proj", "out_proj"],  # Mamba2 mixer
}
MIXING_LAYERS = {
    "llama": ("LlamaAttention",),
    "qwen3_5": ("Qwen3_5Attention", "Qwen3_5GatedDeltaNet"),
    "bamba": ("BambaAttention", "BambaMixer"),
}
# relative to the largest LoRA gradient, fp32. Measured: llama 3.4e-7, qwen3_5 1.8e-6, bamba 9.1e-7.
TOLERANCE = {"llama": 1e-5, "qwen3_5": 1e-4, "bamba": 1e-4}
LENGTHS = [70, 1, 23, 5, 40]


def lora_pair(family_name: str):
    """(unpatched LoRA model, patched LoRA model with gradient checkpointing), identical weights, train mode."""
    torch.manual_seed(0)
    base = build_tiny(family_named(family_name))
    # init_lora_weights=False: B is random too, so the adapters change the forward and both A and B get gradients
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family_name], init_lora_weights=False)
    stock = get_peft_model(base, config).train()
    patched = compilepack.patch(copy.deepcopy(stock))
    patched.get_base_model().gradient_checkpointing_enable()  # non-reentrant checkpointing (transformers' default)
    return stock, patched


def lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def per_document_grads(stock, docs) -> dict[str, torch.Tensor]:
    for doc in docs:
        alone = hf_batch([doc])
        summed_token_loss(stock(input_ids=alone["input_ids"], use_cache=False).logits, alone["labels"]).backward()
    return lora_grads(stock)


def record_mixing_calls(model, class_names) -> list[tuple[bool, str, bool]]:
    """Log (grad mode, layer, got cu_seq_lens_q and seq_idx) for every call of a mixing layer."""
    calls = []

    def hook(module, args, kwargs, output):
        has_boundaries = kwargs.get("cu_seq_lens_q") is not None and kwargs.get("seq_idx") is not None
        calls.append((torch.is_grad_enabled(), type(module).__name__, has_boundaries))

    for module in model.modules():
        if type(module).__name__ in class_names:
            module.register_forward_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize("family_name", ["llama", "qwen3_5", "bamba"])
def test_lora_with_checkpointing_packed_grads_equal_per_document(family_name):
    stock, patched = lora_pair(family_name)
    docs = random_docs(stock.config.vocab_size, LENGTHS, seed=1)
    batch = hf_batch(docs)
    calls = record_mixing_calls(patched, MIXING_LAYERS[family_name])

    loss = summed_token_loss(patched(**batch).logits, batch["labels"])
    forward_calls = len(calls)
    loss.backward()
    packed = lora_grads(patched)
    reference = per_document_grads(stock, docs)

    # every mixing layer ran twice (forward, then recomputed in backward), with the boundaries both times
    recomputed = calls[forward_calls:]
    assert forward_calls > 0 and [name for _, name, _ in recomputed] == [name for _, name, _ in calls[:forward_calls]]
    assert all(has_boundaries for _, _, has_boundaries in calls), calls
    # LoRA on every targeted projection, mixer projections included, got a gradient
    assert packed.keys() == reference.keys()
    for target in LORA_TARGETS[family_name]:
        assert any(f".{target}.lora_A." in name for name in packed), target
    assert relative_grad_error(packed, reference) <= TOLERANCE[family_name]


@pytest.mark.parametrize("family_name", ["llama"])
def test_lora_with_checkpointing_detects_mixed_documents(family_name):
    """The comparison above can fail: the same packed tokens as one document are far off the reference."""
    stock, patched = lora_pair(family_name)
    docs = random_docs(stock.config.vocab_size, LENGTHS, seed=1)
    batch = hf_batch(docs)
    one_document = compilepack.Boundaries.from_lengths([sum(LENGTHS)]).as_kwargs()
    mixed = {**batch, **{k: v for k, v in one_document.items() if k != "position_ids"}}
    mixed["labels"] = batch["labels"]
    summed_token_loss(patched(**mixed).logits, batch["labels"]).backward()
    assert relative_grad_error(lora_grads(patched), per_document_grads(stock, docs)) > 100 * TOLERANCE[family_name]


def _compiled_lora_grads_equal_per_document(family_name):
    stock, patched = lora_pair(family_name)
    # Non-reentrant checkpointing needs no input that requires grad; transformers' hook that sets one on the
    # embeddings (requires_grad_() on an intermediate) cannot be traced with fullgraph=True. Remove it.
    patched.get_base_model().disable_input_require_grads()
    docs = random_docs(stock.config.vocab_size, LENGTHS, seed=1)
    batch = hf_batch(docs)
    report = compilepack.explain(patched, batch, backward=True)
    assert (report.graphs, report.graph_breaks) == (1, 0), str(report)
    compiled = torch.compile(patched, backend="aot_eager", fullgraph=True, dynamic=True)
    summed_token_loss(compiled(**batch).logits, batch["labels"]).backward()
    assert relative_grad_error(lora_grads(patched), per_document_grads(stock, docs)) <= TOLERANCE[family_name]


def test_compiled_lora_with_checkpointing_llama():
    _compiled_lora_grads_equal_per_document("llama")


@pytest.mark.slow
def test_compiled_lora_with_checkpointing_qwen3_5():
    _compiled_lora_grads_equal_per_document("qwen3_5")


# ------------------------------------------------------------------------------------------------ patch state


def _patch_then_peft(model):
    return get_peft_model(compilepack.patch(model), LoraConfig(r=4, target_modules=ATTENTION))


def _peft_then_patch(model):
    return compilepack.patch(get_peft_model(model, LoraConfig(r=4, target_modules=ATTENTION)))


def _peft_then_patch_then_merge(model):
    return _peft_then_patch(model).merge_and_unload()


ORDERS = {
    "patch-peft": _patch_then_peft,
    "peft-patch": _peft_then_patch,
    "peft-patch-merge_and_unload": _peft_then_patch_then_merge,
}


@pytest.mark.parametrize("order", ORDERS)
def test_patch_state_is_seen_through_peft_in_every_order(order):
    """Whichever order PEFT and compilepack are applied in, ``is_patched`` tells the truth about the wrapper and
    the model inside it, the packed batch runs compilepack's forwards, and ``unpatch`` on the outer object leaves
    no compilepack forward anywhere (so the same batch then leaks: stock Llama with a cache mixes documents).
    LoRA's B starts at zero, so the adapted model computes what the base model does."""
    torch.manual_seed(0)
    stock = build_tiny(family_named("llama")).eval()
    docs = random_docs(stock.config.vocab_size, [9, 4, 13])
    batch, alone = hf_batch(docs), logits_alone(stock, docs)
    model = ORDERS[order](copy.deepcopy(stock)).eval()
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model

    def packed_error():
        with torch.no_grad():
            return max_diff_packed_vs_alone(model(**batch, use_cache=True).logits, alone, batch["cu_seq_lens_q"])

    assert compilepack.is_patched(model) and compilepack.is_patched(inner)
    assert packed_error() <= TOLERANCE["llama"]
    compilepack.unpatch(model)
    assert not compilepack.is_patched(model) and not compilepack.is_patched(inner)
    assert [name for name, m in model.named_modules() if "forward" in m.__dict__] == []
    assert packed_error() >= 100 * TOLERANCE["llama"]
