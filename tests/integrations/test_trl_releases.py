"""``compilepack.patch()`` whatever TRL has or lacks (issue 40): the TRL shapes seen across 1.0 to 1.16, made here
from the installed TRL so that the fast suite covers them (CI's TRL stages run the real oldest and newest releases).

- no ``add_fused_lm_head`` (TRL 1.0 to 1.14): ``patch()`` works; it raised ``AttributeError`` before (the control
  below restores that code path's assumption and sees the error);
- a head compilepack does not recognise (a later TRL's, with another option): left as TRL made it, one
  ``UnroutedTrlHeadWarning`` per process, and ``explain`` shows its breaks (the control: TRL's head as it is routes
  to 1 graph, 0 breaks);
- a head whose kernel TRL leaves None (1.15 without Triton): replaced all the same (compilepack never calls it).
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

pytest.importorskip("trl", reason="TRL is an optional test dependency")
import trl.trainer.utils as trl_utils  # noqa: E402

import compilepack  # noqa: E402
from compilepack.integrations import trl as integration  # noqa: E402
from compilepack.integrations.trl import RoutedFusedHead, UnroutedTrlHeadWarning, is_trl_head  # noqa: E402
from compilepack.patching import family_named  # noqa: E402
from tests.families import build_tiny  # noqa: E402
from tests.models import hf_batch, random_docs  # noqa: E402

needs_head = pytest.mark.skipif(not hasattr(trl_utils, "add_fused_lm_head"), reason="this TRL has no fused head")


def tiny_llama():
    torch.manual_seed(0)
    return build_tiny(family_named("llama")).train()


def test_patch_works_with_a_trl_without_the_fused_head(monkeypatch):
    """TRL 1.0 to 1.14 have no ``trl.trainer.utils.add_fused_lm_head``: patch() works and hooks nothing."""
    if hasattr(trl_utils, "add_fused_lm_head"):
        monkeypatch.delattr(trl_utils, "add_fused_lm_head")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: there is no head
        model = compilepack.patch(tiny_llama())
    assert compilepack.is_patched(model)
    integration.hook_trl_heads()  # hooks what this TRL has (1.5-1.14: the chunked_nll head), never raises
    assert not hasattr(trl_utils, "add_fused_lm_head")
    compilepack.unpatch(model)
    # the control: the code before issue 40 read the attribute unguarded, which is what raised for every model
    with pytest.raises(AttributeError, match="add_fused_lm_head"):
        trl_utils.add_fused_lm_head  # noqa: B018


def add_later_trl_head(model):
    """What a later TRL's head looks like to compilepack: TRL's module and name, one option more (it runs TRL's own
    head, so its loss is TRL's)."""
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    trl_head, new_option = model.__dict__["forward"], True

    def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                       **kwargs):
        assert new_option
        return trl_head(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                        num_items_in_batch=num_items_in_batch, **kwargs)

    head = types.FunctionType(_fused_forward.__code__, vars(trl_utils), "_fused_forward", None,
                              _fused_forward.__closure__)
    head.__kwdefaults__ = _fused_forward.__kwdefaults__
    model.forward = types.MethodType(head, model)


@needs_head
def test_unrecognised_head_is_left_alone_with_one_warning_and_explain_shows_the_breaks(monkeypatch):
    monkeypatch.setattr(integration, "_warned_versions", set())
    model = tiny_llama()
    add_later_trl_head(model)
    batch = {**hf_batch(random_docs(model.config.vocab_size, [30, 5, 20])), "fused_lm_head": True}

    with pytest.warns(UnroutedTrlHeadWarning, match=r"does not recognise TRL .*'new_option'.*break the graph"):
        compilepack.patch(model)
    assert is_trl_head(model.__dict__["forward"]) and compilepack.is_patched(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process: a second model, a second head, no second warning
        other = tiny_llama()
        add_later_trl_head(compilepack.patch(other))
        assert is_trl_head(other.__dict__["forward"])
    report = compilepack.explain(model, batch, backward=True)  # TRL's two breaks
    assert report.graph_breaks >= 2 and "non-contiguous `out=`" in report.break_reasons[0], report
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)

    # the control: TRL's head as it is, on the same model, is routed into one graph
    compilepack.unpatch(model)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    compilepack.patch(model)
    assert isinstance(model.__dict__["forward"], RoutedFusedHead)
    report = compilepack.explain(model, batch, backward=True)
    assert (report.graphs, report.graph_breaks) == (1, 0), report


@needs_head
def test_head_without_a_kernel_is_routed_all_the_same(monkeypatch):
    """TRL 1.15 without Triton leaves ``_ChunkedLogProbFunction`` None (TRL's own step cannot run). compilepack's
    forward never calls TRL's kernel, so the head is replaced and runs (the control: TRL's head itself fails)."""
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", None)
    model = tiny_llama()
    trl_utils.add_fused_lm_head(model)
    trl_head = model.__dict__["forward"]
    batch = {**hf_batch(random_docs(model.config.vocab_size, [30, 5, 20])), "fused_lm_head": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compilepack.patch(model)
    assert isinstance(model.__dict__["forward"], RoutedFusedHead)
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)
        with pytest.raises(AttributeError, match="apply"):
            trl_head(**batch)


def chunked_ce_installer():
    import trl.trainer.sft_trainer as sft_trainer

    installer = getattr(sft_trainer, "_patch_chunked_ce_lm_head", None)
    return getattr(installer, "__compilepack_original__", installer)


@pytest.mark.skipif(chunked_ce_installer() is None, reason="this TRL has no chunked_nll head (TRL 1.5 to 1.14 have)")
def test_chunked_ce_head_of_trl_1_14_is_routed_into_one_graph():
    """TRL 1.5-1.14's ``loss_type="chunked_nll"`` head (SFTTrainer's default in 1.14), added before patch: routed,
    1 graph 0 breaks, and its loss, correct-token count and entropy sum equal TRL's own (fp32). The control: TRL's own
    head on the same patched model breaks the graph (its loop runs a number of chunks read from the data)."""
    model = tiny_llama()
    chunked_ce_installer()(model, chunk_size=16)  # small chunks: several in TRL's loop
    trl_head = model.__dict__["forward"]
    batch = hf_batch(random_docs(model.config.vocab_size, [30, 5, 20]))
    compilepack.patch(model)
    routed = model.__dict__["forward"]
    assert isinstance(routed, RoutedFusedHead) and routed.trl_forward is trl_head
    report = compilepack.explain(model, batch, backward=True)
    assert (report.graphs, report.graph_breaks) == (1, 0), report
    with torch.no_grad():
        ours = model(**batch)
        model.forward = trl_head
        theirs = model(**batch)
    assert abs(ours.loss.item() - theirs.loss.item()) <= 1e-6
    assert ours.num_correct_tokens == theirs.num_correct_tokens and ours.num_valid_tokens == theirs.num_valid_tokens
    assert abs(ours.entropy_sum.item() - theirs.entropy_sum.item()) <= 1e-4 * abs(theirs.entropy_sum.item())
    report = compilepack.explain(model, batch, backward=True)  # the control: TRL's own head, not routed
    assert report.graph_breaks >= 1, report
    model.forward = routed
    compilepack.unpatch(model)
    assert model.__dict__["forward"] is trl_head
