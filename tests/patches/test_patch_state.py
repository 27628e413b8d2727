"""The patch state cannot lie: it is read from the forwards actually bound, and a patched model that is pickled,
saved with ``torch.save`` or deep-copied comes back patched, running compilepack's forwards, not stock's.

Three families cover the three places a patched forward sits: Llama (decoder and attention), Mamba2 (the top-level
``Mamba2ForCausalLM`` itself is patched: its forward is part of the object being unpickled) and Qwen3-Next (Gated
DeltaNet, whose stock code raises on packed batches instead of leaking).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

import compilepack
from compilepack.patching import family_named, patch_state
from compilepack.patching.api import PatchedForward
from tests.models import build_pair, hf_batch, logits_alone, max_diff_packed_vs_alone, random_docs

FAMILIES = ["llama", "mamba2", "qwen3_next"]
LENGTHS = [70, 1, 23, 5]  # one document longer than the mixers' chunk (64), one of a single token
# fp32 packed vs alone, as in tests/patches/test_families.py (measured: llama 2e-7, mamba2 1.4e-6, qwen3_next 1.8e-7)
TOLERANCE = 1e-4


def _torch_save_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS = {
    "pickle": lambda model: pickle.loads(pickle.dumps(model)),
    "torch.save": _torch_save_load,
    "deepcopy": copy.deepcopy,
}


@pytest.fixture(scope="module")
def cases():
    """family name -> (stock model, patched model, batch, each document's logits alone through stock)."""
    cache = {}

    def get(name):
        if name not in cache:
            stock, patched = build_pair(family_named(name))
            docs = random_docs(stock.config.vocab_size, LENGTHS)
            cache[name] = stock, patched, hf_batch(docs), logits_alone(stock, docs)
        return cache[name]

    return get


def _packed(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def _instance_forwards(model) -> dict[str, object]:
    return {name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__}


@pytest.mark.parametrize("round_trip", ROUND_TRIPS)
@pytest.mark.parametrize("family_name", FAMILIES)
def test_round_trip_comes_back_patched(cases, family_name, round_trip):
    """Same packed logits, bit for bit, as before the round trip, and so each document as alone; the same modules
    run compilepack's forward, each bound to its own (new) module."""
    _, patched, batch, alone = cases(family_name)
    before = _packed(patched, batch)
    loaded = ROUND_TRIPS[round_trip](patched)
    forwards = _instance_forwards(loaded)
    assert forwards.keys() == _instance_forwards(patched).keys()
    assert all(isinstance(f, PatchedForward) and f.module is loaded.get_submodule(n) for n, f in forwards.items())
    assert compilepack.is_patched(loaded)
    after = _packed(loaded, batch)
    assert torch.equal(after, before)
    assert max_diff_packed_vs_alone(after, alone, batch["cu_seq_lens_q"]) <= TOLERANCE


@pytest.mark.parametrize("family_name", FAMILIES)
def test_a_stock_forward_after_the_round_trip_would_be_caught(cases, family_name):
    """The control of the test above: the unpickled model with compilepack's forwards removed (what an unpickled
    model used to run) leaks across documents far beyond the tolerance, or refuses the packed batch."""
    _, patched, batch, alone = cases(family_name)
    loaded = compilepack.unpatch(pickle.loads(pickle.dumps(patched)))
    assert not compilepack.is_patched(loaded) and not _instance_forwards(loaded)
    try:
        error = max_diff_packed_vs_alone(_packed(loaded, batch), alone, batch["cu_seq_lens_q"])
    except ValueError as refusal:  # Qwen3-Next's stock GDN: "can't keep packed sequences apart without causal_conv1d"
        assert "packed sequences" in str(refusal)
    else:
        assert error >= 100 * TOLERANCE


@pytest.mark.parametrize("family_name", ["llama", "mamba2"])
def test_unpickled_model_compiles_to_one_graph_of_compilepack_ops(cases, family_name):
    """fullgraph=True (a break would raise), one graph, and that graph calls compilepack's ops, not stock's."""
    _, patched, batch, _ = cases(family_name)
    loaded = pickle.loads(pickle.dumps(patched))
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with torch.no_grad():
        torch.compile(loaded, backend=capture, fullgraph=True, dynamic=True)(**batch)
    assert len(graphs) == 1
    called = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert any(target.startswith("compilepack.") for target in called), sorted(called)


def test_patch_and_unpatch_work_on_an_unpickled_model(cases):
    _, patched, batch, alone = cases("llama")
    loaded = pickle.loads(pickle.dumps(patched))
    forwards = _instance_forwards(loaded)
    assert compilepack.patch(loaded) is loaded and _instance_forwards(loaded) == forwards  # already patched: no-op
    compilepack.unpatch(loaded)
    assert not compilepack.is_patched(loaded) and not _instance_forwards(loaded)
    compilepack.patch(loaded)
    assert _instance_forwards(loaded).keys() == forwards.keys()
    assert max_diff_packed_vs_alone(_packed(loaded, batch), alone, batch["cu_seq_lens_q"]) <= TOLERANCE


def test_save_pretrained_then_from_pretrained_then_patch(cases, tmp_path):
    stock, patched, batch, alone = cases("llama")
    patched.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not compilepack.is_patched(loaded)  # weights and config only: forwards are not saved
    compilepack.patch(loaded)
    assert max_diff_packed_vs_alone(_packed(loaded, batch), alone, batch["cu_seq_lens_q"]) <= TOLERANCE


def test_is_patched_is_read_from_the_forwards():
    """No flag stands in for the forwards: removing them by hand makes the model report stock, and a compilepack
    forward that ``patch`` did not set (copied onto another module) is still seen and removed by ``unpatch``."""
    _, patched = build_pair(family_named("llama"))
    stray = copy.deepcopy(patched)
    for module in patched.modules():
        module.__dict__.pop("forward", None)
    assert not compilepack.is_patched(patched) and patch_state(patched) is None
    patched.model.layers[0].self_attn = stray.model.layers[0].self_attn  # one patched layer, grafted
    assert compilepack.is_patched(patched)
    assert patch_state(patched).modules == (patched.model.layers[0].self_attn,)
    compilepack.unpatch(patched)
    assert not _instance_forwards(patched)
