"""The patching mechanism (``compilepack/patching/rebind.py``): renamed global loads on the live module globals,
drift detection from the bytecode, threaded calls, and composition with tools that rebind module globals."""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch

import compilepack
from compilepack.errors import IncompatibleTransformersError
from compilepack.patching import CAUSAL_CONV1D, Family, build_forwards, family_named
from compilepack.patching.rebind import BOUNDARIES_HELPER, boundary_kwargs, global_loads, innermost, with_globals
from tests.families import available_families, build_tiny
from tests.models import hf_batch, logits_alone, max_diff_packed_vs_alone, random_docs


def kernel(x, **kwargs):
    return "stock", x, kwargs


def replacement(x, **kwargs):
    return "replaced", x, kwargs


def _decorator(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


@_decorator
def forward(x, attention_mask=None, **kwargs):
    return kernel(x, attention_mask=attention_mask)


def forward_without_kwargs(x):
    return kernel(x)


class Holder:
    kernel = staticmethod(kernel)

    def forward(self, x, **kwargs):
        return self.kernel(x)  # reaches the kernel through an attribute: not a global load


@pytest.fixture
def installed():
    module = sys.modules[__name__]
    module.__dict__["__test_replacement"] = replacement
    module.__dict__[BOUNDARIES_HELPER] = boundary_kwargs
    yield {"kernel": "__test_replacement"}
    del module.__dict__["__test_replacement"], module.__dict__[BOUNDARIES_HELPER]


def test_renamed_global_load_reads_the_replacement_and_keeps_decorators(installed):
    rebound = with_globals(forward, installed)
    assert rebound(1)[0] == "replaced" and forward(1)[0] == "stock"  # the stock function is untouched
    assert hasattr(rebound, "__wrapped__") and innermost(rebound).__globals__ is forward.__globals__


def test_other_globals_are_read_live(installed):
    """The copy shares the module's own globals: a global rebound after the copy was made is seen."""
    rebound = with_globals(forward, installed)
    global replacement
    original = replacement
    try:
        sys.modules[__name__].__dict__["__test_replacement"] = lambda x, **kw: ("later", x, kw)
        assert rebound(1)[0] == "later"
    finally:
        sys.modules[__name__].__dict__["__test_replacement"] = original


def test_attribute_access_is_not_a_global_load():
    assert "kernel" in global_loads(forward_without_kwargs.__code__)
    assert "kernel" not in global_loads(Holder.forward.__code__)
    assert "kernel" in Holder.forward.__code__.co_names  # what the old co_names check was fooled by


def test_threaded_call_receives_only_the_boundary_kwargs(installed):
    threaded = with_globals(forward, installed, ("kernel",))
    _, _, received = threaded(1, seq_idx="s", cu_seq_lens_q="cu", max_length_q=None, labels="not a boundary")
    assert received == {"attention_mask": None, "cu_seq_lens_q": "cu", "seq_idx": "s"}
    _, _, stock_received = forward(1, seq_idx="s")
    assert stock_received == {"attention_mask": None}


def test_threaded_copy_keeps_file_and_line_numbers(installed):
    threaded = with_globals(forward, installed, ("kernel",))
    stock_code, copy_code = innermost(forward).__code__, innermost(threaded).__code__
    body_lines = lambda code: {line for *_, line in code.co_lines() if line is not None} - {code.co_firstlineno}  # noqa
    assert copy_code.co_filename == stock_code.co_filename
    assert body_lines(copy_code) == body_lines(stock_code)  # tracebacks point at the stock source


def test_threading_refuses_what_it_cannot_do(installed):
    with pytest.raises(IncompatibleTransformersError, match="no longer calls self.mixer"):
        with_globals(forward, installed, ("self.mixer",))
    with pytest.raises(IncompatibleTransformersError, match="no \\*\\*kwargs parameter"):
        with_globals(forward_without_kwargs, installed, ("kernel",))


def test_threading_refuses_source_that_does_not_match_the_loaded_code(installed):
    edited = types.FunctionType(
        (lambda x, **kwargs: kernel(x, extra=1)).__code__.replace(
            co_name="forward", co_firstlineno=innermost(forward).__code__.co_firstlineno
        ),
        forward.__globals__,
    )
    edited.__module__ = __name__
    with pytest.raises(IncompatibleTransformersError, match="does not match the loaded code"):
        with_globals(edited, installed, ("kernel",))


# ------------------------------------------------------------------------------------------------ drift detection


def test_a_forward_reaching_the_kernel_through_an_attribute_is_refused(monkeypatch):
    """A transformers release whose layer calls ``self.causal_conv1d_fn(...)`` instead of the module global: the
    name is still in ``co_names``, but nothing would be rebound, so patch() must refuse, naming what changed."""
    modeling = types.ModuleType("stand_in_modeling")
    modeling.causal_conv1d_fn = kernel
    modeling.create_causal_mask = lambda *a, **k: None
    modeling.Decoder = type("Decoder", (torch.nn.Module,), {"forward": lambda self, **kwargs: None})
    modeling.Mixer = Holder
    monkeypatch.setitem(sys.modules, "stand_in_modeling", modeling)
    family = Family("stand_in", "stand_in_modeling", decoder="Decoder", layers={"Mixer": (CAUSAL_CONV1D,)})
    with pytest.raises(IncompatibleTransformersError, match="cannot patch stand_in: Mixer.forward no longer loads the "
                       "global causal_conv1d_fn"):
        build_forwards(family, compilepack.Backends())


@pytest.mark.parametrize("family", available_families(), ids=lambda f: f.name)
def test_every_rebound_forward_loads_what_it_replaces(family):
    """For every registered family on the installed transformers: each layer's forward loads, as a global, every
    name its replacements rebind, or the stock helper in front of it (``Replacement.via``, transformers 5.25), or
    nothing for a fused kernel the release dropped (what patch() checks); the rebound copy no longer loads that
    stock name."""
    forwards = build_forwards(family, compilepack.Backends())
    for class_name, needed in family.layers.items():
        cls = next(c for c in forwards if c.__name__ == class_name)
        stock_loads = global_loads(innermost(cls.forward).__code__)
        patched_loads = global_loads(innermost(forwards[cls]).__code__)
        for r in needed:
            loaded = [name for name in (r.global_name, *r.via) if name in stock_loads]
            assert loaded or r.optional, f"{class_name} loads neither {r.global_name} nor {r.via}"
            for name in loaded:
                assert name not in patched_loads, f"{class_name} still loads the stock {name}"


# ------------------------------------------------------------------------------------------------ composition


def _counting_rotary(modeling):
    """A stand-in for a module-global patcher (Liger-Kernel's apply_liger_kernel_to_llama rebinds
    ``apply_rotary_pos_emb``): the same function, counting its calls."""
    stock = modeling.apply_rotary_pos_emb
    calls = []

    def apply_rotary_pos_emb(*args, **kwargs):
        calls.append(1)
        return stock(*args, **kwargs)

    return apply_rotary_pos_emb, calls


@pytest.mark.parametrize("order", ["patcher_first", "compilepack_first"])
def test_a_module_global_patcher_composes_in_either_order(monkeypatch, order):
    from transformers.models.llama import modeling_llama

    family = family_named("llama")
    torch.manual_seed(0)
    model = build_tiny(family).eval()
    counting, calls = _counting_rotary(modeling_llama)
    if order == "patcher_first":
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", counting)
        compilepack.patch(model)
    else:
        compilepack.patch(model)
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", counting)
    docs = random_docs(model.config.vocab_size, [9, 1, 14])
    batch = hf_batch(docs)
    with torch.no_grad():
        packed = model(**batch).logits
    assert len(calls) == model.config.num_hidden_layers  # every patched attention layer used the patcher's function
    compilepack.unpatch(model)
    assert max_diff_packed_vs_alone(packed, logits_alone(model, docs), batch["cu_seq_lens_q"]) <= 1e-5


def test_liger_kernel_composes_if_it_imports(monkeypatch):
    """Liger-Kernel itself (its kernels are Triton: not run here, only its rebinding is checked)."""
    liger = pytest.importorskip("liger_kernel.transformers", reason="liger-kernel does not import here")
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))  # restored after the test
    model = compilepack.patch(build_tiny(family_named("llama")))
    liger.apply_liger_kernel_to_llama(rope=True, rms_norm=False, swiglu=False, cross_entropy=False,
                                      fused_linear_cross_entropy=False)
    attention_globals = innermost(model.model.layers[0].self_attn.forward.__func__).__globals__
    assert attention_globals["apply_rotary_pos_emb"] is modeling_llama.apply_rotary_pos_emb
    assert modeling_llama.apply_rotary_pos_emb.__module__.startswith("liger_kernel")


def test_a_class_level_forward_change_is_picked_up_by_the_next_patch(monkeypatch):
    """patch() copies the class's current forward: a tool that wraps the class forward later (functools.wraps)
    is kept for instances patched afterwards, not frozen out by a cache."""
    from transformers.models.llama import modeling_llama

    before = compilepack.patch(build_tiny(family_named("llama")).eval())
    stock_forward = modeling_llama.LlamaAttention.forward
    calls = []

    @functools.wraps(stock_forward)
    def counting(self, *args, **kwargs):
        calls.append(1)
        return stock_forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", counting)
    after = compilepack.patch(build_tiny(family_named("llama")).eval())
    batch = hf_batch(random_docs(after.config.vocab_size, [5, 7]))
    with torch.no_grad():
        before(**batch)
        assert calls == []
        after(**batch)
    assert len(calls) == after.config.num_hidden_layers
