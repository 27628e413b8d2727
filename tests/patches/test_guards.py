"""The patched model guards its own boundaries: every rule, eager and compiled, every family.

A batch built by hand (or by a collator compilepack never saw) reaches the model without ``validate``. Each broken
rule must stop the step with the rule's message before a result comes back: eager with a host check
(``BoundaryError``), compiled with the static refusal at trace time or an asynchronous device assert at run time
(``RuntimeError``), and never silently. The control: the valid batch runs and equals each document alone.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compilepack import BoundaryError
from tests.families import available_families, representatives, variants
from tests.models import build_pair, hf_batch, logits_alone, max_diff_packed_vs_alone, random_docs

LENGTHS = [5, 3, 6, 2]  # 16 tokens: one row of 16, or two rows of 8 (5+3 | 6+2)
CU = [0, 5, 8, 14, 16]


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


def _set(**changes):
    """Change keys of the valid batch (None: drop the key). ``cu``: both cu_seq_lens_q and _k, two equal tensors as
    the HF collator passes them (so a compiled model sees the inputs' structure unchanged and does not recompile)."""

    def change(batch):
        updates = dict(changes)
        if "cu" in updates:
            cu = updates.pop("cu")
            updates["cu_seq_lens_q"], updates["cu_seq_lens_k"] = cu, getattr(cu, "clone", lambda: list(cu))()
        for key, value in updates.items():
            batch.pop(key, None) if value is None else batch.__setitem__(key, value)
        return batch

    return change


def _two_rows_with_a_crossing_document(batch):
    """Two rows of 8 whose boundaries put a document across the row edge (tokens 5:11)."""
    batch = {key: value.view(2, 8) if key in ("input_ids", "labels", "position_ids") else value
             for key, value in batch.items()}
    batch.update(cu_seq_lens_q=_cu([0, 5, 11, 16]), cu_seq_lens_k=None, seq_idx=None, position_ids=None)
    return {key: value for key, value in batch.items() if value is not None}


# rule -> (how the valid batch is broken, what the refusal says). Value rules: checked on the host in eager and in
# the graph when compiled; the message's "'key': expected ..." is the same in both.
VALUE_RULES = {
    "starts at 0": (_set(cu=_cu([1, 5, 8, 14, 16])), r"'cu_seq_lens_q': expected 0 as the first entry"),
    "ends at the token count": (_set(cu=_cu([0, 5, 8, 14, 15])), r"'cu_seq_lens_q': expected the batch's token count"),
    "non-decreasing": (_set(cu=_cu([0, 8, 5, 14, 16])), r"'cu_seq_lens_q': expected non-decreasing entries"),
    "row edges are document edges": (_two_rows_with_a_crossing_document, r"'cu_seq_lens_q': expected every row edge"),
    "cu_seq_lens_k equals cu_seq_lens_q": (
        _set(cu_seq_lens_k=_cu([0, 4, 8, 14, 16])), r"'cu_seq_lens_k': expected the same values"
    ),
    "max_length bounds every document": (
        _set(max_length_q=4), r"'max_length_q': expected a Python int >= the longest document"
    ),
    "seq_idx agrees": (
        _set(seq_idx=torch.tensor([[0] * 6 + [1] * 2 + [2] * 6 + [3] * 2], dtype=torch.int32)),
        r"'seq_idx': expected document starts at the same tokens as 'cu_seq_lens_q'",
    ),
}
# Static rules: decided by types, ranks, devices and present keys, so refused while tracing when compiled.
STATIC_RULES = {
    "integer cu_seq_lens": (_set(cu=torch.tensor([0.0, 5, 8, 14, 16])), r"'cu_seq_lens_q': expected a 1-D int32"),
    "cu_seq_lens shaped [N+1]": (_set(cu=_cu([[0, 5, 8, 14, 16]])), r"'cu_seq_lens_q': expected a 1-D int32"),
    "cu_seq_lens per row": (_set(cu=_cu([[0, 5, 8], [0, 6, 8]])), r"'cu_seq_lens_q': expected a 1-D int32"),
    "cu_seq_lens a tensor": (_set(cu=CU), r"'cu_seq_lens_q': expected a 1-D int32.*found a list"),
    "max_length an int": (_set(max_length_q=5.5), r"'max_length_q': expected a Python int"),
    "seq_idx shaped like input_ids": (
        _set(seq_idx=torch.zeros(1, 15, dtype=torch.int32)),
        r"'seq_idx': expected an int32 \(or int64\) tensor shaped like input_ids",
    ),
    "no attention_mask": (
        _set(attention_mask=torch.ones(1, 16, dtype=torch.long)), r"'attention_mask': expected no padding mask"
    ),
    "cu_seq_lens_q present": (_set(cu_seq_lens_q=None, cu_seq_lens_k=None), r"'cu_seq_lens_q': expected present"),
}

FAMILIES = [pytest.param(f, variants(f)[0], id=f.name) for f in available_families()]
# compiled, the families beyond one per combination of mixers (and the headline ones) are CI's slow stage
COMPILED_FAMILIES = [
    pytest.param(*case.values, id=case.id,
                 marks=() if (case.values[0].name, case.values[1]) in representatives() else pytest.mark.slow)
    for case in FAMILIES
]


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family, variant):
        if family.name not in cache:
            stock, patched = build_pair(family, variant)
            docs = random_docs(stock.config.get_text_config().vocab_size, LENGTHS)
            cache[family.name] = stock, patched, docs
        return cache[family.name]

    return get


def _valid(docs):
    return hf_batch(docs)


@pytest.mark.parametrize("family, variant", FAMILIES)
def test_every_broken_rule_is_refused_eager(models, family, variant):
    stock, patched, docs = models(family, variant)
    with torch.no_grad():
        logits = patched(**_valid(docs)).logits  # the control: the valid batch runs, exactly per document
    assert max_diff_packed_vs_alone(logits, logits_alone(stock, docs), _valid(docs)["cu_seq_lens_q"]) < 1e-4
    for rule, (breaks, message) in {**VALUE_RULES, **STATIC_RULES}.items():
        with pytest.raises(BoundaryError, match=message), torch.no_grad():
            patched(**breaks(_valid(docs)))
            pytest.fail(f"{family.name}: a batch breaking '{rule}' ran")


@pytest.mark.parametrize("family, variant", COMPILED_FAMILIES)
def test_every_broken_rule_is_refused_compiled(models, family, variant):
    """fullgraph and dynamic: the value rules are device asserts of the one graph (no recompile for them), the static
    ones are refused while tracing with the rule's message first. A host read of a boundary would break the graph,
    which fullgraph turns into an error: passing, this also shows the guards add no host sync. (That the guards add
    no break and no recompile over a stream of valid batches is tests/patches/test_families.py's stream test.)"""
    _, patched, docs = models(family, variant)
    compiled = torch.compile(patched, backend="eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        expected = patched(**_valid(docs)).logits
        assert torch.allclose(compiled(**_valid(docs)).logits, expected, atol=1e-5)
        for rule, (breaks, message) in {**VALUE_RULES, **STATIC_RULES}.items():
            with pytest.raises(RuntimeError, match=message):
                compiled(**breaks(_valid(docs)))
                pytest.fail(f"{family.name}: a batch breaking '{rule}' ran compiled")


@pytest.mark.parametrize("family, variant", [f for f in FAMILIES if f.id in ("llama", "qwen3_5", "bamba")])
def test_static_refusals_of_a_compiled_model_are_caught_as_boundary_errors(models, family, variant):
    """``except compilepack.BoundaryError`` catches a compiled model's refusal as it catches the eager one: the
    static rules are refused while dynamo traces, and dynamo would rewrap any other exception type as an
    InternalTorchDynamoError without a cause. The message is the eager one (the rule's text first)."""
    from compilepack.distributed import ContextParallel, ContextParallelError, shard_batch

    _, patched, docs = models(family, variant)
    compiled = torch.compile(patched, backend="eager", fullgraph=True, dynamic=True)
    cases = {**STATIC_RULES,
             "meta boundaries": (_set(cu=_cu(CU).to("meta")), r"'cu_seq_lens_q': expected a tensor on "),
             "float seq_idx": (_set(seq_idx=torch.zeros(1, 16)), r"'seq_idx': expected an int32")}
    with torch.no_grad():
        for rule, (breaks, message) in cases.items():
            with pytest.raises(BoundaryError, match="^" + message):
                compiled(**breaks(_valid(docs)))
                pytest.fail(f"{family.name}: a batch breaking '{rule}' ran compiled")
            torch._dynamo.reset()
        sharded = shard_batch(_valid(docs), ContextParallel(None, 1, 0), verify=False)
        with pytest.raises(ContextParallelError, match="^the batch was sharded for context parallelism"):
            compiled(**sharded)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ nothing silent


@st.composite
def corrupted_boundaries(draw):
    """Valid boundaries of LENGTHS with one random corruption: entries moved, dropped, duplicated or replaced."""
    cu = list(CU)
    kind = draw(st.sampled_from(["move", "drop", "duplicate", "replace", "shift", "max_length", "seq_idx"]))
    batch_changes = {}
    if kind == "move":
        at = draw(st.integers(0, len(cu) - 1))
        cu[at] = draw(st.integers(-3, 20))
    elif kind == "drop":
        del cu[draw(st.integers(0, len(cu) - 1))]
    elif kind == "duplicate":
        at = draw(st.integers(0, len(cu) - 1))
        cu.insert(at, cu[at])
    elif kind == "replace":
        cu = draw(st.lists(st.integers(-2, 18), min_size=2, max_size=7))
    elif kind == "shift":
        cu = [c + draw(st.integers(-2, 2)) for c in cu]
    elif kind == "max_length":
        batch_changes["max_length_q"] = batch_changes["max_length_k"] = draw(st.integers(0, 16))
    else:
        ids = draw(st.lists(st.integers(0, 4), min_size=16, max_size=16))
        batch_changes["seq_idx"] = torch.tensor([ids], dtype=torch.int32)
    return cu, batch_changes


@pytest.fixture(scope="module")
def llama_and_qwen3_5():
    from compilepack.patching import family_named

    return {name: build_pair(family_named(name)) for name in ("llama", "qwen3_5")}


@given(corrupted=corrupted_boundaries(), family=st.sampled_from(["llama", "qwen3_5"]))
def test_nothing_is_silent(llama_and_qwen3_5, corrupted, family):
    """Every corruption is either refused with BoundaryError, or forms valid boundaries of other documents, which
    then give exactly each of those documents run alone."""
    stock, patched = llama_and_qwen3_5[family]
    docs = random_docs(stock.config.vocab_size, LENGTHS)
    batch = _valid(docs)
    cu, changes = corrupted
    batch.update(cu_seq_lens_q=_cu(cu), cu_seq_lens_k=_cu(cu), **changes)
    try:
        with torch.no_grad():
            logits = patched(**batch).logits
    except BoundaryError:
        return
    tokens = batch["input_ids"][0].tolist()
    accepted = [tokens[s:e] for s, e in zip(cu[:-1], cu[1:])]
    alone = logits_alone(stock, [d for d in accepted if d])
    kept = _cu([0, *[e for s, e in zip(cu[:-1], cu[1:]) if e > s]])
    assert max_diff_packed_vs_alone(logits, alone, kept) < 1e-4, (cu, changes)
