"""``compilepack.integrations.with_boundaries``: position_ids-only packed batches get validated boundary kwargs."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

import compilepack
from compilepack.integrations import add_boundaries, with_boundaries
from compilepack.patching import family_named
from tests.integrations.common import LOSS_TOLERANCE, per_sample_loss
from tests.models import build_pair, hf_batch, random_docs

LENGTHS = [30, 1, 5, 20, 70]


def features(vocab_size=256):
    return [{"input_ids": d} for d in random_docs(vocab_size, LENGTHS)]


def test_position_ids_only_batch_is_refused_without_the_adapter():
    batch = DataCollatorWithFlattening()(features())  # HF's default: no boundary kwargs
    assert "cu_seq_lens_q" not in batch
    with pytest.raises(compilepack.BoundaryError,
                       match=r"'position_ids': .*found a restart at row 0, token 30 and no boundary kwargs"):
        compilepack.checked(DataCollatorWithFlattening())(features())


def test_adds_exactly_the_kwargs_the_hf_collator_would_emit():
    added = with_boundaries(DataCollatorWithFlattening())(features())
    expected = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features())
    assert sorted(added) == sorted(expected)
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert torch.equal(added[key], value.to(added[key].dtype)) and added[key].shape == value.shape, key
        else:
            assert added[key] == value, key
    assert added["cu_seq_lens_q"].dtype == torch.int32 and added["seq_idx"].dtype == torch.int32


@pytest.mark.parametrize("family_name", ["llama", "qwen3_5"])
def test_patched_loss_on_adapted_batch_equals_per_sample_loss(family_name):
    stock, patched = build_pair(family_named(family_name))
    batch = with_boundaries(DataCollatorWithFlattening())(features(stock.config.vocab_size))
    with torch.no_grad():
        packed = patched(**batch).loss.item()
    reference, _ = per_sample_loss(stock, batch)
    assert abs(packed - reference) <= LOSS_TOLERANCE, (packed, reference)


def test_batches_with_boundaries_or_padding_pass_through_unchanged():
    flash = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features())
    cu_seqlens = flash["cu_seq_lens_q"]
    assert add_boundaries(flash)["cu_seq_lens_q"] is cu_seqlens
    padded = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1] * 4, [1, 1, 0, 0]])}
    assert sorted(add_boundaries(dict(padded))) == ["attention_mask", "input_ids"]


def test_multimodal_positions_use_their_text_row():
    batch = DataCollatorWithFlattening()(features())
    text_positions = batch["position_ids"]
    batch["position_ids"] = text_positions.unsqueeze(0).expand(3, -1, -1)  # [3, rows, T] RoPE positions
    add_boundaries(batch)
    assert batch["position_ids"].shape == (3, 1, sum(LENGTHS))
    assert batch["cu_seq_lens_q"].tolist() == [0, 30, 31, 36, 56, 126]


def test_labels_that_cross_documents_are_refused():
    # separator_id=5 leaves a real label at each document start: the loss would predict across documents
    collate = with_boundaries(DataCollatorWithFlattening(separator_id=5))
    with pytest.raises(compilepack.BoundaryError,
                       match=r"'labels': expected -100 at every document start"
                             r".*found 5 at the document start at token 30"):
        collate(features())


def test_to_device_moves_the_tokens_and_keeps_the_boundaries_on_the_host():
    batch = hf_batch([[5, 6, 7], [8, 9]])
    moved = compilepack.to_device(batch, "meta")
    for key in ("input_ids", "labels", "position_ids", "seq_idx"):
        assert moved[key].device.type == "meta", key
    assert moved["cu_seq_lens_q"] is batch["cu_seq_lens_q"] and moved["cu_seq_lens_k"] is batch["cu_seq_lens_k"]
    assert moved["max_length_q"] == batch["max_length_q"]
