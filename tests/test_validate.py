"""Bad boundaries are refused on the host, before any compute, with a message naming the key and the fix."""

from __future__ import annotations

import pytest
import torch

import compilepack
from compilepack import BoundaryError, validate
from tests.models import hf_batch


def _batch(lengths=(3, 5, 2)):
    return hf_batch([list(range(1, n + 1)) for n in lengths])


def _with(**changes):
    batch = _batch()
    for key, value in changes.items():
        if value is None:
            batch.pop(key)
        else:
            batch[key] = value
    return batch


def test_hf_collator_batch_is_valid():
    boundaries = validate(_batch())
    assert boundaries.lengths == [3, 5, 2] and boundaries.max_seqlen == 5


def test_zero_length_documents_are_valid():
    batch = _with(cu_seq_lens_q=torch.tensor([0, 3, 3, 8, 10, 10], dtype=torch.int32),
                  cu_seq_lens_k=torch.tensor([0, 3, 3, 8, 10, 10], dtype=torch.int32))
    assert validate(batch).lengths == [3, 0, 5, 2, 0]


def test_unpacked_batch_without_boundaries_is_valid():
    assert validate({"input_ids": torch.ones(2, 7, dtype=torch.long)}) is None
    assert validate({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None]}) is None


BAD = {
    "cu_seqlens not starting at 0": (
        dict(cu_seq_lens_q=torch.tensor([1, 3, 8, 10], dtype=torch.int32), cu_seq_lens_k=None),
        r"'cu_seq_lens_q' must start at 0, got 1",
    ),
    "decreasing cu_seqlens": (
        dict(cu_seq_lens_q=torch.tensor([0, 8, 3, 10], dtype=torch.int32), cu_seq_lens_k=None),
        r"'cu_seq_lens_q' must be non-decreasing, but entry 2 \(3\) < entry 1 \(8\)",
    ),
    "last value != token count": (
        dict(cu_seq_lens_q=torch.tensor([0, 3, 8], dtype=torch.int32), cu_seq_lens_k=None),
        r"'cu_seq_lens_q' ends at 8 but the batch has 10 tokens",
    ),
    "float cu_seqlens": (
        dict(cu_seq_lens_q=torch.tensor([0.0, 3, 8, 10]), cu_seq_lens_k=None),
        r"'cu_seq_lens_q' must be an integer tensor \(int32\), got torch.float32",
    ),
    "cu_seq_lens_q != cu_seq_lens_k": (
        dict(cu_seq_lens_k=torch.tensor([0, 4, 8, 10], dtype=torch.int32)),
        r"'cu_seq_lens_k' .* differs from 'cu_seq_lens_q'",
    ),
    "max_length smaller than the longest document": (
        dict(max_length_q=4),
        r"'max_length_q'=4 is smaller than the longest document \(5 tokens\)",
    ),
    "max_length as a tensor": (
        dict(max_length_q=torch.tensor(5)),
        r"'max_length_q' must be a Python int, got Tensor",
    ),
    "seq_idx of the wrong length": (
        dict(seq_idx=torch.zeros(1, 9, dtype=torch.int32)),
        r"'seq_idx' must have the shape of input_ids \(1, 10\), got \(1, 9\)",
    ),
    "seq_idx inconsistent with cu_seqlens": (
        dict(seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2]], dtype=torch.int32)),
        r"'seq_idx' disagrees with 'cu_seq_lens_q' at row 0, token 3",
    ),
    "attention_mask together with boundaries": (
        dict(attention_mask=torch.ones(1, 10, dtype=torch.long)),
        r"'attention_mask' was passed together with boundary kwargs",
    ),
    "seq_idx without cu_seqlens": (
        dict(cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None),
        r"no 'cu_seq_lens_q'",
    ),
    "position_ids that do not restart": (
        dict(position_ids=torch.arange(10)[None]),
        r"'position_ids' do not restart at each document: token 3 \(document 1, tokens 3:8\)",
    ),
    "labels that predict across documents": (
        dict(labels=torch.arange(1, 11)[None]),
        r"'labels' at document start 3 is 4, expected -100",
    ),
    "boundaries of a different batch": (
        dict(input_ids=torch.ones(1, 12, dtype=torch.long)),
        r"ends at 10 but the batch has 12 tokens",
    ),
}


@pytest.mark.parametrize("changes, message", BAD.values(), ids=BAD.keys())
def test_bad_batch_is_refused(changes, message):
    with pytest.raises(BoundaryError, match=message):
        validate(_with(**changes))


def test_boundary_error_is_a_value_error():
    assert issubclass(BoundaryError, ValueError)


def test_rows_with_boundaries_for_one_flattened_row_are_refused():
    batch = _batch((3, 5, 2))
    batch = {k: (v.view(2, 5) if k in ("input_ids", "labels", "position_ids", "seq_idx") else v) for k, v in batch.items()}
    with pytest.raises(BoundaryError, match=r"document 1 \(tokens 3:8\) crosses a row edge \(rows of 5\)"):
        validate(batch)


def test_packed_rows_without_boundaries_are_refused():
    batch = _batch()
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
        batch.pop(key)
    with pytest.raises(BoundaryError, match=r"'position_ids' restart inside a row \(row 0, token 3\).*never infers"):
        validate(batch)


def test_empty_batch_is_refused():
    with pytest.raises(BoundaryError, match="the batch is empty"):
        validate({"input_ids": torch.ones(1, 0, dtype=torch.long)})
    with pytest.raises(BoundaryError, match="neither 'input_ids' nor 'inputs_embeds'"):
        validate({})


def test_checked_collator_validates_every_batch():
    def broken_collator(features):
        batch = hf_batch(features)
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"] + 1
        return batch

    collate = compilepack.checked(broken_collator)
    with pytest.raises(BoundaryError, match="must start at 0"):
        collate([[1, 2, 3], [4, 5]])


def test_validation_never_runs_inside_the_model(monkeypatch):
    """Checks live on the host: a patched forward neither calls validate nor adds a guard for it."""
    import compilepack.validation as validate_module
    from compilepack.patching import family_named
    from tests.models import build_pair

    def fail(*args, **kwargs):
        raise AssertionError("validate ran inside the model")

    monkeypatch.setattr(validate_module, "validate", fail)
    monkeypatch.setattr(compilepack, "validate", fail)
    _, patched = build_pair(family_named("llama"))
    patched(**_batch())
