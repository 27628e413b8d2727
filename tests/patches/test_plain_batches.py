"""Batches without boundary kwargs run exactly as stock, every family (first variant).

Dropout, attention weights, padded and unpadded rows: the patched model runs the stock decoder forward and stock
attention for them, so outputs (and errors) are stock's. A position_ids-only packed row is never inferred: where
stock itself keeps its documents apart (``Family.stock_packs_positions``: attention-only families, building no
cache) it runs stock's code; elsewhere it is refused. The table in docs/models.md ("Packed rows without
boundaries") is what these tests measure.
"""

from __future__ import annotations

import copy

import pytest
import torch

from compilepack import BoundaryError
from tests.families import available_families, variants
from tests.models import build_pair, hf_batch, logits_alone, max_diff_packed_vs_alone, random_docs

LENGTHS = [9, 1, 14, 6]
FAMILIES = [pytest.param(f, variants(f)[0], id=f.name) for f in available_families()]


def _has_attention(model) -> bool:
    return any(type(m).__name__.endswith("Attention") for m in model.modules())


def _plain_batches(vocab: int) -> dict[str, dict]:
    torch.manual_seed(1)
    input_ids = torch.randint(1, vocab, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    return {
        "unpadded": {"input_ids": input_ids, "labels": input_ids},
        "all-ones mask": {"input_ids": input_ids, "attention_mask": torch.ones_like(mask), "labels": input_ids},
        "padded": {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)},
    }


def _with_dropout(family, variant, p=0.1):
    stock, patched = build_pair(family, variant)
    for model in (stock, patched):
        for module in model.modules():  # attention layers copy config.attention_dropout when built
            if isinstance(getattr(module, "attention_dropout", None), float):
                module.attention_dropout = p
        model.train()
    return stock, patched


@pytest.mark.parametrize("family, variant", FAMILIES)
def test_plain_batches_train_with_dropout_exactly_as_stock(family, variant):
    stock, patched = _with_dropout(family, variant)
    for name, batch in _plain_batches(stock.config.get_text_config().vocab_size).items():
        losses = []
        for model in (stock, patched):
            torch.manual_seed(0)  # the same dropout masks
            losses.append(model(**batch, use_cache=False).loss)
        assert torch.equal(losses[0], losses[1]), (name, losses)


@pytest.mark.parametrize("family, variant", FAMILIES)
def test_output_attentions_on_plain_batches_as_stock(family, variant):
    stock, patched = build_pair(family, variant)
    for model in (stock, patched):
        model.set_attn_implementation("eager")
    for name, batch in _plain_batches(stock.config.get_text_config().vocab_size).items():
        with torch.no_grad():
            expected = getattr(stock(**batch, output_attentions=True, use_cache=False), "attentions", ())
            got = getattr(patched(**batch, output_attentions=True, use_cache=False), "attentions", ())
        assert len(got) == len(expected), name
        assert len(expected) > 0 or not _has_attention(stock), name
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), name


@pytest.mark.parametrize("family, variant", FAMILIES)
def test_packed_batches_refuse_what_their_attention_cannot_do(family, variant):
    stock, patched = _with_dropout(family, variant)
    if not _has_attention(stock):
        pytest.skip("no attention layer")
    docs = random_docs(stock.config.get_text_config().vocab_size, LENGTHS)
    if any(isinstance(getattr(m, "attention_dropout", None), float) for m in patched.modules()):
        with pytest.raises(NotImplementedError, match=r"attention dropout \(0\.1\) is not supported on packed batches"):
            patched(**hf_batch(docs))
    patched.eval()  # (LFM2's attention has no dropout)
    with pytest.raises(NotImplementedError, match="output_attentions=True is not supported on packed batches"), \
            torch.no_grad():
        patched(**hf_batch(docs), output_attentions=True)


@pytest.mark.parametrize("family, variant", FAMILIES)
def test_position_ids_only_packed_rows_run_stock_or_are_refused(family, variant):
    """Stock exact (to 1e-5) -> patched gives stock's logits bit for bit; stock leaking or raising -> refused."""
    stock, patched = build_pair(family, variant)
    docs = random_docs(stock.config.get_text_config().vocab_size, LENGTHS)
    batch = hf_batch(docs)
    positions_only = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    stock_error = _stock_error(stock, positions_only, docs, batch["cu_seq_lens_q"])
    if family.stock_packs_positions:
        assert stock_error < 1e-5, f"{family.name}: stock leaks {stock_error:.2e}: it must not be run"
        with torch.no_grad():
            assert torch.equal(patched(**positions_only).logits, stock(**positions_only).logits)
        with pytest.raises(BoundaryError, match="'position_ids': expected positions counting up"):
            patched(**positions_only | {"use_cache": True})  # stock builds a cache and leaks then
    else:
        assert stock_error > 1e-5, f"{family.name}: stock is exact ({stock_error:.2e}): it should run stock"
        with pytest.raises(BoundaryError, match="'position_ids': expected positions counting up"):
            patched(**positions_only)


def _stock_error(stock, batch, docs, cu) -> float:
    """Stock's packed-vs-alone error on a position_ids-only row (inf when stock raises)."""
    try:
        with torch.no_grad():
            logits = copy.deepcopy(stock)(**batch).logits
    except Exception:  # noqa: BLE001 - any stock failure counts as "stock cannot run this row"
        return float("inf")
    return max_diff_packed_vs_alone(logits, logits_alone(stock, docs), cu)
