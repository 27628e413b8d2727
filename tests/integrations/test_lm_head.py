"""``compilepack.patch(model, lm_head="chunked")``: the causal-LM loss from the chunked LM head op, never the [T, V]
logits, exactly the stock ``ForCausalLMLoss``.

Exactness (fp32, tiny models, packed batches): the loss within 1e-6 relative of the same patched model with the stock
head, with ``labels``, ``num_items_in_batch`` (gradient accumulation), ``shift_labels`` (context-parallel shards) and
a custom ``ignore_index``; every parameter's gradient within 1e-6 relative to its own largest entry for llama
(measured <= 4.2e-7), within 1e-6 of the model's largest gradient for qwen3_5 and bamba (their gated-delta / SSD
decay parameters' gradients nearly cancel, and fp32 noise reaches 8e-5 of those small tensors, FINDINGS.md). Each
input the loss reads is also dropped once (a control): the loss then misses by far more than the tolerance.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

import compilepack
from compilepack.ops.backends import resolve
from compilepack.patching import patch_state
import compilepack.patching.chunked_head as chunked_head
from compilepack.errors import CompilepackError, IncompatibleTransformersError
from compilepack.patching.chunked_head import ChunkedCausalLMForward
from compilepack.patching import family_named
from tests.compiling import graphs_compiled
from tests.families import available_families, build_tiny, variants
from tests.models import hf_batch, random_docs, varied_length_batches

LOSS_TOL = 1e-6
GRAD_TOL = 1e-6
DOCS = [30, 5, 20, 1, 12]


def pair(family_name: str, seed: int = 0):
    """(patched with the stock head, patched with the chunked head): the same weights, training mode."""
    torch.manual_seed(seed)
    base = build_tiny(family_named(family_name)).train()
    return compilepack.patch(copy.deepcopy(base)), compilepack.patch(copy.deepcopy(base), lm_head="chunked")


def batch_for(model) -> dict:
    return hf_batch(random_docs(model.config.vocab_size, DOCS))


def case_inputs(case: str, batch: dict) -> dict:
    labels = batch["labels"]
    if case == "labels":
        return {}
    if case == "num_items_in_batch":  # Trainer's gradient accumulation: the targets of every micro-batch
        return {"num_items_in_batch": torch.tensor(3 * int((labels[:, 1:] != -100).sum()))}
    if case == "shift_labels":  # pre-shifted and unrelated to labels: only shift_labels may count
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return {"shift_labels": shifted.roll(5, dims=-1)}
    if case == "ignore_index":  # another ignore value; -100 is then an ordinary (out-of-range) id: replace it
        relabelled = labels.masked_fill(labels == -100, 7)
        relabelled[0, 10:16] = 7
        return {"labels": relabelled, "ignore_index": 7}
    raise ValueError(case)


def loss_and_grads(model, batch, extra) -> tuple[torch.Tensor, dict]:
    """The loss and {name: gradient} of every trainable parameter (None where the loss does not reach it)."""
    loss = model(**{**batch, **extra}).loss
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return loss, {n: g for (n, _), g in zip(named, grads)}


CASES = ["labels", "num_items_in_batch", "shift_labels", "ignore_index"]


@pytest.mark.parametrize("family_name", ["llama", "qwen3_5", "bamba"])
@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_equal_the_stock_head(family_name, case):
    stock, chunked = pair(family_name)
    batch = batch_for(stock)
    extra = case_inputs(case, batch)
    loss, grads = loss_and_grads(stock, batch, extra)
    loss_c, grads_c = loss_and_grads(chunked, batch, extra)
    assert chunked(**{**batch, **extra}).logits is None  # the [T, V] logits are never built
    assert abs(loss_c.item() - loss.item()) <= LOSS_TOL * abs(loss.item())
    largest = max(g.abs().max().item() for g in grads.values() if g is not None)
    for name, want in grads.items():
        got = grads_c[name]
        if want is None:
            assert got is None
            continue
        scale = want.abs().max().item() if family_name == "llama" else largest
        assert (got - want).abs().max().item() <= GRAD_TOL * scale, name


@pytest.mark.parametrize("case, dropped", [("num_items_in_batch", "NUM_ITEMS_IN_BATCH"),
                                           ("shift_labels", "SHIFT_LABELS"), ("ignore_index", "ignore_index")])
def test_control_each_input_dropped_misses(case, dropped, monkeypatch):
    """The comparison above can fail: the chunked head with one of its loss inputs ignored misses stock's loss."""
    stock, chunked = pair("llama")
    batch = batch_for(stock)
    extra = case_inputs(case, batch)
    if dropped == "ignore_index":  # score the ignored positions as class 0
        original = chunked_head.lm_head_logprobs
        monkeypatch.setattr(chunked_head, "lm_head_logprobs",
                            lambda h, w, b, t, ignore_index, **kw: original(h, w, b, t.clamp(min=0), **kw))
        extra = {**extra, "labels": batch["labels"]}
    else:
        monkeypatch.setattr(chunked_head, dropped, "a key no batch has")
    with torch.no_grad():
        want = stock(**{**batch, **case_inputs(case, batch)}).loss.item()
        got = chunked(**{**batch, **extra}).loss.item()
    assert abs(got - want) > 100 * LOSS_TOL * abs(want)


def test_bf16_autocast_within_twice_the_stock_heads_error():
    """Under bf16 autocast, loss and gradients against the fp32 stock reference: the chunked head's error is at most
    twice the stock head's own bf16 error (the logits are computed in bf16 as stock's are; the rest in fp32)."""
    stock, chunked = pair("llama")
    batch = batch_for(stock)
    loss_ref, grads_ref = loss_and_grads(stock, batch, {})
    errors = {}
    for name, model in (("stock", stock), ("chunked", chunked)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, grads = loss_and_grads(model, batch, {})
        errors[name] = [abs(loss.item() - loss_ref.item())] + [
            (grads[n] - r).abs().max().item() / r.abs().max().item() for n, r in grads_ref.items() if r is not None]
    assert all(c <= 2 * s + 1e-6 for c, s in zip(errors["chunked"], errors["stock"])), errors
    assert max(errors["stock"]) > 1e-3  # compared at bf16 precision


@pytest.mark.parametrize("family_name", ["llama"])  # qwen3_5 and bamba: compiled through SFTTrainer, test_trl.py
def test_one_graph_no_break_one_compile(family_name):
    """Forward + backward of the chunked loss: 1 graph, 0 breaks (explain); one compile over 6 varied packed training
    steps (fullgraph, dynamic, aot_eager, backward included); compiled losses equal eager's."""
    _, chunked = pair(family_name)
    batches = varied_length_batches(chunked.config.vocab_size, count=6, max_len=90)
    report = compilepack.explain(chunked, batches[0], backward=True)
    assert (report.graphs, report.graph_breaks) == (1, 0), report
    with torch.no_grad():
        eager = [chunked(**batch).loss.item() for batch in batches]
    compiled = torch.compile(chunked, fullgraph=True, dynamic=True, backend="aot_eager")
    with graphs_compiled() as compiles:
        for batch, want in zip(batches, eager):
            loss = compiled(**batch).loss
            loss.backward()
            chunked.zero_grad(set_to_none=True)
            assert abs(loss.item() - want) <= 1e-6 * abs(want)
        assert compiles() == 1


def test_without_labels_the_stock_forward_runs():
    """Generation and evaluation without labels: the stock forward, logits bit-identical, generate unchanged."""
    stock, chunked = pair("llama")
    stock.eval(), chunked.eval()
    batch = {k: v for k, v in batch_for(stock).items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(chunked(**batch).logits, stock(**batch).logits)
        prompt = torch.tensor([[5, 9, 2, 11]])
        assert torch.equal(chunked.generate(prompt, max_new_tokens=5, do_sample=False),
                           stock.generate(prompt, max_new_tokens=5, do_sample=False))


def test_signature_pickling_copies_and_unpatch():
    _, chunked = pair("llama")
    stock_signature = inspect.signature(type(chunked).forward.__get__(chunked))
    assert inspect.signature(chunked.forward) == stock_signature
    batch = batch_for(chunked)
    with torch.no_grad():
        want = chunked(**batch).loss
        buffer = io.BytesIO()
        torch.save(chunked, buffer)
        for restored in (torch.load(io.BytesIO(buffer.getvalue()), weights_only=False),
                         pickle.loads(pickle.dumps(chunked)), copy.deepcopy(chunked)):
            assert isinstance(restored.__dict__["forward"], ChunkedCausalLMForward)
            assert restored.forward.module is restored
            assert torch.equal(restored(**batch).loss, want)
    # patched again without lm_head (as a trainer integration does), with the same backends or others: the head stays
    for backend in ("auto", "reference"):
        compilepack.patch(chunked, backend=backend)
        assert isinstance(chunked.__dict__["forward"], ChunkedCausalLMForward), backend
        assert patch_state(chunked).backends == resolve(backend)
    compilepack.unpatch(chunked)
    assert "forward" not in chunked.__dict__ and not compilepack.is_patched(chunked)


def test_peft_lora_on_the_lm_head():
    """LoRA on lm_head and q_proj: the adapters' gradients equal those of the stock head (the update joins the head's
    weight inside the op's input); a LoRA dropout on the head is refused, naming the fix."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = build_tiny(family_named("llama")).train()
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    stock = compilepack.patch(peft.get_peft_model(copy.deepcopy(base), config))
    chunked = compilepack.patch(peft.get_peft_model(copy.deepcopy(base), config), lm_head="chunked")
    chunked.load_state_dict(stock.state_dict())
    batch = batch_for(base)
    loss, grads = loss_and_grads(stock, batch, {})
    loss_c, grads_c = loss_and_grads(chunked, batch, {})
    assert abs(loss_c.item() - loss.item()) <= LOSS_TOL * abs(loss.item())
    assert any("lm_head.lora_B" in n for n in grads)
    for name, want in grads.items():
        assert (grads_c[name] - want).abs().max() <= GRAD_TOL * want.abs().max(), name
    dropout = compilepack.patch(peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, target_modules=["lm_head"], lora_dropout=0.1)), lm_head="chunked").train()
    with pytest.raises(CompilepackError, match="Set lora_dropout=0 for the LM head"):
        dropout(**batch)


def test_bad_requests_are_refused():
    model = build_tiny(family_named("llama"))
    with pytest.raises(ValueError, match=r"lm_head='fast' is not known; expected one of \['chunked'\]"):
        compilepack.patch(model, lm_head="fast")
    assert not compilepack.is_patched(model)  # refused before anything changed
    compilepack.patch(model, lm_head="chunked")
    batch = batch_for(model)
    with pytest.raises(ValueError, match="logits_to_keep must be 0"):
        model(**batch, logits_to_keep=1)
    with pytest.raises(ValueError, match="labels has 4 positions but the model returned"):
        model(**{**batch, "labels": batch["labels"][:, :4]})


@pytest.mark.parametrize("family, variant", [(f, v) for f in available_families() for v in variants(f)],
                         ids=lambda x: x if isinstance(x, str) else x.name)
def test_every_family_gets_the_stock_loss_or_a_refusal(family, variant):
    """Registry-wide, every tiny variant (multimodal wrappers included): the chunked head reproduces the model's own
    loss (forward, fp32), or refuses it at patch time with the reason; never a silently different loss."""
    torch.manual_seed(0)
    base = build_tiny(family, variant).train()
    if hasattr(base, "z_loss_coefficient"):  # Bamba's z-loss, off in its config: on, so that it is compared too
        base.z_loss_coefficient = 0.01
    # MoE families: the load-balancing loss joins the loss (its own forward's rule) and is compared too
    extra = {"output_router_logits": True} if family.tiny_model(variant).moe else {}
    stock = compilepack.patch(copy.deepcopy(base))
    try:
        chunked = compilepack.patch(copy.deepcopy(base), lm_head="chunked")
    except (IncompatibleTransformersError, CompilepackError) as refusal:
        assert "chunked" in str(refusal)
        return
    batch = hf_batch(random_docs(base.config.get_text_config().vocab_size, DOCS))
    with torch.no_grad():
        want, got = stock(**batch, **extra).loss.item(), chunked(**batch, **extra).loss.item()
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


@pytest.mark.parametrize("family_name, rescale", [
    pytest.param("falcon_h1", lambda model: setattr(model.model, "lm_head_multiplier", 0.25), id="falcon_h1-times"),
    pytest.param("granitemoehybrid", lambda model: setattr(model.config, "logits_scaling", 4.0), id="granite-divided"),
])
def test_logit_scaling_read_from_the_forward_joins_the_loss(family_name, rescale):
    """The scale a family's forward applies to its head's output, read from the forward's syntax (an attribute path,
    multiplied or divided), at a value far from 1: the chunked loss equals the stock one. The control: the same head
    left unscaled misses by far."""
    torch.manual_seed(0)
    base = build_tiny(family_named(family_name)).train()
    rescale(base)
    stock, chunked = compilepack.patch(copy.deepcopy(base)), compilepack.patch(copy.deepcopy(base), lm_head="chunked")
    head = chunked.__dict__["forward"]
    assert head.plan.scaling is not None
    batch = hf_batch(random_docs(base.config.get_text_config().vocab_size, DOCS))
    with torch.no_grad():
        want, got = stock(**batch).loss.item(), chunked(**batch).loss.item()
        assert abs(got - want) <= LOSS_TOL * abs(want), (got, want)
        head.plan = dataclasses.replace(head.plan, scaling=None)  # the control
        assert abs(chunked(**batch).loss.item() - want) > 100 * LOSS_TOL * abs(want)


@pytest.mark.parametrize("statements", [
    ["logits = self.lm_head(hidden_states)", "logits = logits / self.config.final_logit_softcapping",
     "logits = torch.tanh(logits)"],
    ["logits = self.lm_head(hidden_states) * 2.0"],
    ["logits = self.lm_head(hidden_states)", "logits = self.lm_head(hidden_states)"],
    ["logits = self.score(hidden_states)"],
], ids=["softcap", "constant", "two-heads", "other-module"])
def test_logits_computed_otherwise_are_refused(statements, tmp_path):
    """A forward whose logits the chunked head would not reproduce is refused, its statements quoted."""
    source = "def forward(self, hidden_states):\n" + "".join(f"    {line}\n" for line in statements)
    path = tmp_path / "modeling_other.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("modeling_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(IncompatibleTransformersError, match=r"cannot reproduce other: .*logits = self\."):
        chunked_head._logit_scaling(module.forward, "other")
