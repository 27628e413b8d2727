"""patch / unpatch / patched: per instance, idempotent, reversible, refusing what it cannot do safely."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaForCausalLM

import compilepack
from compilepack import (
    BoundaryError,
    IncompatibleTransformersError,
    PatchConflictError,
    UnsupportedModelError,
)
from compilepack.ops.backends import Backends
from compilepack.patching import ATTENTION, Family, build_forwards, family_named
from tests.families import tiny_config
from tests.models import hf_batch, logits_alone, max_diff_packed_vs_alone, random_docs

LLAMA = family_named("llama")


def _model(seed=0, config=None):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config or tiny_config(LLAMA)).eval()


def _instance_forwards(model):
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


def _packed_error(model, use_cache=True):
    docs = random_docs(model.config.vocab_size, [9, 4, 13])
    batch = hf_batch(docs)
    with torch.no_grad():
        return max_diff_packed_vs_alone(model(**batch, use_cache=use_cache).logits, logits_alone(model, docs),
                                        batch["cu_seq_lens_q"])


def test_patch_changes_only_that_instance():
    config = tiny_config(LLAMA)
    first, second = _model(config=config), _model(config=config)
    assert first.config is second.config  # transformers shares the config object between instances
    compilepack.patch(first)
    assert _packed_error(first) <= 1e-5
    assert _packed_error(second) > 1e-2  # the other instance is stock: it leaks with use_cache=True
    assert all(f is None for f in _instance_forwards(second).values())
    assert type(first) is type(second) is LlamaForCausalLM


def test_unpatch_restores_forwards_and_leaves_weights_bitwise_identical():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compilepack.patch(model)
    assert compilepack.is_patched(model)
    patched_modules = [n for n, f in _instance_forwards(model).items() if f is not None]
    assert patched_modules == ["model"] + [f"model.layers.{i}.self_attn" for i in range(2)]
    compilepack.unpatch(model)
    assert not compilepack.is_patched(model)
    assert all(f is None for f in _instance_forwards(model).values())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_patch_twice_equals_patch_once():
    model = compilepack.patch(_model())
    forwards = _instance_forwards(model)
    assert compilepack.patch(model) is model
    assert _instance_forwards(model) == forwards


def test_patched_context_restores_on_exit():
    model = _model()
    with compilepack.patched(model) as inside:
        assert inside is model and compilepack.is_patched(model)
    assert not compilepack.is_patched(model)
    compilepack.patch(model)
    with compilepack.patched(model):
        pass
    assert compilepack.is_patched(model)  # it was patched before the block: it stays patched


def test_patch_survives_to_train_eval_and_deepcopy():
    model = compilepack.patch(_model())
    model.train().eval()
    model.to(torch.float64)
    assert _packed_error(model) <= 1e-9
    clone = copy.deepcopy(model)
    assert compilepack.is_patched(clone) and _packed_error(clone) <= 1e-9
    compilepack.unpatch(clone)
    assert compilepack.is_patched(model)


def test_save_pretrained_of_a_patched_model_loads_into_a_stock_model(tmp_path):
    model = compilepack.patch(_model())
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    original = model.state_dict()
    assert all(torch.equal(original[k], v) for k, v in loaded.state_dict().items())
    assert not compilepack.is_patched(loaded)


def test_unsupported_model_names_the_supported_families():
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2'.*Supported model types: .*llama"):
        compilepack.patch(AutoModelForCausalLM.from_config(config))


def test_compiled_model_is_refused():
    compiled = torch.compile(_model())
    with pytest.raises(PatchConflictError, match="call compilepack.patch\\(model\\) first"):
        compilepack.patch(compiled)


def test_forward_replaced_by_another_tool_is_refused():
    model = _model()
    attention = model.model.layers[0].self_attn
    attention.forward = lambda *args, **kwargs: None
    with pytest.raises(PatchConflictError, match="LlamaAttention already has an instance-level forward"):
        compilepack.patch(model)
    assert not compilepack.is_patched(model)


def test_unpatch_refuses_a_forward_another_tool_wrapped_after_patch():
    """accelerate's hooks wrap the instance forward compilepack set: unpatch would leave a wrapper that still calls
    compilepack while patched() said False. It refuses, changing nothing, until the hook is removed."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model = compilepack.patch(_model())
    attention = model.model.layers[0].self_attn
    add_hook_to_module(attention, ModelHook())
    with pytest.raises(PatchConflictError, match="wrapped by another tool after compilepack.patch"):
        compilepack.unpatch(model)
    assert compilepack.is_patched(model)
    remove_hook_from_module(attention)
    compilepack.unpatch(model)
    assert not compilepack.is_patched(model) and "forward" not in attention.__dict__


def test_unpatch_refuses_a_decorated_forward():
    import functools

    model = compilepack.patch(_model())
    decoder = model.model
    ours = decoder.forward
    decoder.forward = functools.wraps(ours)(lambda *args, **kwargs: ours(*args, **kwargs))
    with pytest.raises(PatchConflictError, match="LlamaModel"):
        compilepack.unpatch(model)
    assert compilepack.is_patched(model)


def test_incompatible_transformers_is_named():
    missing_class = Family("x", LLAMA.modeling, "LlamaModel", {"LlamaGone": (ATTENTION,)})
    with pytest.raises(IncompatibleTransformersError,
                       match=r"LlamaGone does not exist.*compilepack supports x on transformers>=5.18,<5.26"):
        build_forwards(missing_class, Backends())
    not_calling = Family("x", LLAMA.modeling, "LlamaModel", {"LlamaMLP": (ATTENTION,)})
    with pytest.raises(IncompatibleTransformersError,
                       match="LlamaMLP.forward no longer loads the global ALL_ATTENTION_FUNCTIONS"):
        build_forwards(not_calling, Backends())


def test_a_family_outside_its_releases_is_refused_naming_them():
    future = Family("future", LLAMA.modeling, "LlamaModel", {"LlamaAttention": (ATTENTION,)}, transformers=">=99")
    assert not future.available
    with pytest.raises(IncompatibleTransformersError, match=r"cannot patch future: this family is not supported in "
                       r"transformers 5\.\d+\.\d+\. compilepack supports future on transformers.*>=99"):
        build_forwards(future, Backends())


def test_packed_batch_with_attention_mask_or_cache_is_refused_in_the_model():
    model = compilepack.patch(_model())
    batch = hf_batch([[1, 2, 3], [4, 5]])
    with pytest.raises(BoundaryError,
                       match="'attention_mask': expected no padding mask in a batch with boundary kwargs"):
        model(**batch, attention_mask=torch.ones(1, 5, dtype=torch.long))
    from transformers import DynamicCache

    with pytest.raises(BoundaryError, match="'past_key_values': expected no cache with a packed batch"):
        model(**batch, cache=DynamicCache(config=model.config))


def test_unpacked_batches_keep_stock_behaviour():
    """Padded batches and generation are not packed: a patched model gives exactly the stock outputs."""
    stock = _model()
    model = compilepack.patch(copy.deepcopy(stock))
    input_ids = torch.randint(1, 200, (2, 9))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    with torch.no_grad():
        assert torch.allclose(model(input_ids, attention_mask=attention_mask).logits,
                              stock(input_ids, attention_mask=attention_mask).logits, atol=1e-6)
        assert torch.allclose(model(input_ids).logits, stock(input_ids).logits, atol=1e-6)
    generated = model.generate(input_ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, stock.generate(input_ids[:1], max_new_tokens=5, do_sample=False))


def test_boundaries_on_the_host_are_moved_once_and_positions_derived():
    """cu_seq_lens may stay on the host; position_ids may be omitted: both come from cu_seq_lens_q."""
    model = compilepack.patch(_model())
    docs = random_docs(model.config.vocab_size, [5, 8, 2])
    batch = hf_batch(docs)
    without_positions = {k: v for k, v in batch.items() if k not in ("position_ids", "seq_idx")}
    with torch.no_grad():
        full = model(**batch).logits
        derived = model(**without_positions).logits
    assert torch.equal(full, derived)


def test_packed_rows_without_boundaries_fail_loudly_in_the_model():
    """A position_ids-only packed batch would run as one sequence: the patched model refuses it, eager on the CPU
    with compilepack's own BoundaryError (a host check), compiled with an async device assert (no host sync);
    unpacked rows with ordinary position_ids still run."""
    model = compilepack.patch(_model())
    batch = hf_batch([[1, 2, 3], [4, 5]])
    positions_only = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    with pytest.raises(BoundaryError,
                       match="'position_ids': expected positions counting up without restart inside a row"):
        model(**positions_only)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    with pytest.raises(RuntimeError,
                       match="'position_ids': expected positions counting up without restart inside a row"):
        compiled(**positions_only)
    model(input_ids=batch["input_ids"], position_ids=torch.arange(5)[None])


@pytest.mark.parametrize("turned_off", [True, False], ids=["patched", "control-left-on"])
def test_hub_kernels_left_on_by_from_pretrained_never_drop_the_patch(tmp_path, monkeypatch, turned_off):
    """transformers loads with use_kernels=True where the `kernels` package is installed, and train() / eval() then
    re-kernelize: patch() turns that off (with a warning), so every patched forward stays. The control leaves it on
    and loses the Gated DeltaNet's forwards, as the packed GRPO trainer first did."""
    pytest.importorskip("kernels")
    family_named("qwen3_5").tiny_model().build().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    if not model.use_kernels:
        pytest.skip("this transformers does not turn Hub kernels on at load")
    if not turned_off:
        monkeypatch.setattr(compilepack.patching.api, "_turn_off_hub_kernels", lambda model: None)
        compilepack.patch(model)
    else:
        with pytest.warns(UserWarning, match="turned off transformers' Hub kernels"):
            compilepack.patch(model)
    patched = len(compilepack.patching.patch_state(model).modules)
    model.train()
    model.eval()
    state = compilepack.patching.patch_state(model)
    assert (len(state.modules) if state else 0) == patched if turned_off else (len(state.modules) < patched)
