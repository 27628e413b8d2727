"""Every registered family, with every tiny variant: packed == alone, one graph, one compile.

Parametrised over the registry, so a new file in patches/ is tested here without editing this file.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils

import compilepack
from compilepack import testing
from tests.families import GROUPED_MM_FALLBACK_BREAKS, available_families, is_moe, representatives, variants
from tests.models import (
    build_pair,
    hf_batch,
    logits_alone,
    max_diff_packed_vs_alone,
    random_docs,
    varied_length_batches,
)

# documents longer than the mixers' chunk (64), 1-token documents, and ordinary ones
LENGTHS = [70, 1, 23, 5, 1, 40]

CASES = [
    pytest.param(family, variant, id=f"{family.name}-{variant}")
    for family in available_families()
    for variant in variants(family)
]
# The compile tests over every case are the exhaustive matrix: the README's command compiles one family per
# combination of mixers and the headline families; CI's slow stage compiles the rest.
COMPILE_CASES = [
    pytest.param(*case.values, id=case.id,
                 marks=() if (case.values[0].name, case.values[1]) in representatives() else pytest.mark.slow)
    for case in CASES
]


def _tolerance(patched) -> float:
    """1e-5 when only attention mixes tokens, 1e-4 with other mixers (compilepack.testing's tolerances)."""
    return testing.tolerance_for(patched)


@pytest.fixture(scope="module")
def pairs():
    cache = {}

    def get(family, variant):
        key = (family.name, variant)
        if key not in cache:
            cache[key] = build_pair(family, variant)
        return cache[key]

    return get


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("family, variant", CASES)
def test_packed_logits_equal_each_document_alone(pairs, family, variant, use_cache):
    stock, patched = pairs(family, variant)
    docs = random_docs(stock.config.get_text_config().vocab_size, LENGTHS)
    testing.assert_packed_matches_unpacked(patched, testing.packed_batch(docs), reference=stock, gradients=False,
                                           control=False, use_cache=use_cache)


@pytest.mark.parametrize("family, variant", CASES)
def test_tolerance_catches_dropped_boundaries(pairs, family, variant):
    """The control of the test above: the same documents run as one long document (boundaries dropped) must miss
    the tolerance by at least 100x, or the tolerance could not tell a leak from rounding."""
    stock, patched = pairs(family, variant)
    docs = random_docs(stock.config.get_text_config().vocab_size, LENGTHS)
    result = testing.check_packed_matches_unpacked(patched, testing.packed_batch(docs), reference=stock,
                                                   gradients=False)
    error = result.values["control"]
    assert error >= 100 * _tolerance(patched), f"boundaries dropped: error {error:.2e} only"
    assert result.passed, str(result)


@pytest.mark.parametrize("family, variant", CASES)
def test_packed_gradients_equal_sum_over_documents(pairs, family, variant):
    """Parameter gradients of the summed token loss: packed == the sum over documents run alone, relative to the
    largest gradient entry (some gated-delta-rule parameters' summed gradients nearly cancel)."""
    stock, patched = pairs(family, variant)
    docs = random_docs(stock.config.get_text_config().vocab_size, LENGTHS, seed=1)
    result = testing.assert_packed_matches_unpacked(patched, testing.packed_batch(docs), reference=stock,
                                                    control=False)
    assert result.values["gradients"] <= _tolerance(patched)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("family, variant", COMPILE_CASES)
def test_one_graph_no_breaks(pairs, family, variant, backward, request):
    if backward and GROUPED_MM_FALLBACK_BREAKS and is_moe(family, variant):
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "transformers < 5.23: the stock MoE experts' CPU grouped_mm fallback backward calls .item() (a graph "
            "break outside the patched layers; 1 graph from 5.23, and on CUDA)")))
    _, patched = pairs(family, variant)
    patched.train(backward)
    try:
        batch = hf_batch(random_docs(patched.config.get_text_config().vocab_size, LENGTHS, seed=3))
        report = compilepack.explain(patched, batch, backward=backward)
    finally:
        patched.eval()
    assert (report.graphs, report.graph_breaks) == (1, 0), str(report)


@pytest.mark.parametrize("family, variant", COMPILE_CASES)
def test_compiles_once_over_varied_hf_batches_and_stays_correct(pairs, family, variant):
    """One aot_eager compile (fullgraph, dynamic) serves 10 batches of different lengths and document counts,
    and every compiled output equals the eager one; the first batch is also checked against each document alone."""
    stock, patched = pairs(family, variant)
    vocab = patched.config.get_text_config().vocab_size
    docs = random_docs(vocab, LENGTHS, seed=2)
    batches = [hf_batch(docs)] + varied_length_batches(vocab, count=9)
    assert len({b["input_ids"].shape[1] for b in batches}) > 5
    assert len({b["cu_seq_lens_q"].numel() for b in batches}) > 3
    compiled = torch.compile(patched, backend="aot_eager", fullgraph=True, dynamic=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        outputs = [compiled(**batch).logits for batch in batches]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
        for batch, output in zip(batches, outputs):
            assert (output - patched(**batch).logits).abs().max().item() <= _tolerance(patched)
    first = max_diff_packed_vs_alone(outputs[0], logits_alone(stock, docs), batches[0]["cu_seq_lens_q"])
    assert first <= _tolerance(patched)


# the families the benchmark's default run compiles with specialize_float (python -m benchmarks: llama and the
# three hybrids), first variant each (every case would add ~80 s per stage)
BENCH_FAMILIES = ("llama", "qwen3_next", "qwen3_5", "bamba")
BENCH_CASES = [case for case in CASES if case.values[0].name in BENCH_FAMILIES
               and case.values[1] == variants(case.values[0])[0]]


@pytest.mark.parametrize("family, variant", BENCH_CASES)
def test_compiles_once_with_float_attributes_specialized(pairs, family, variant):
    """The compile recipe's optional setting (docs/compile.md): with ``specialize_float`` the modules' float
    attributes are constants, and varied HF batches (no float in them) still take one compile."""
    _, patched = pairs(family, variant)
    batches = varied_length_batches(patched.config.get_text_config().vocab_size, count=6, seed=4)
    assert len({b["input_ids"].shape[1] for b in batches}) > 3
    with torch._dynamo.config.patch(specialize_float=True):
        report = compilepack.count_compiles(patched, batches, dynamic=True, fullgraph=True, reset=True)
    assert report.compiles == 1, str(report)


@pytest.mark.parametrize("family, variant", COMPILE_CASES)
def test_fixed_shape_collator_compiles_once_without_dynamic(pairs, family, variant):
    _, patched = pairs(family, variant)
    collate = compilepack.PackedCollator(128, fixed_shape=True, rows=2, max_docs=16)
    batches = []
    vocab = patched.config.get_text_config().vocab_size
    for i, batch in enumerate(varied_length_batches(vocab, count=6, max_len=60, seed=10)):
        docs = [d for d in torch.split(batch["input_ids"][0], torch.diff(batch["cu_seq_lens_q"]).tolist())]
        batches.append(collate([{"input_ids": d} for d in docs]))
    assert len({tuple(b["input_ids"].shape) for b in batches}) == 1
    report = compilepack.count_compiles(patched, batches, dynamic=None, fullgraph=True)
    assert report.compiles == 1, str(report)
