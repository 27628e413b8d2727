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


def test_max_length_as_a_host_tensor_is_read_on_the_host():
    assert validate(_with(max_length_q=torch.tensor(7), max_length_k=torch.tensor(7))).max_seqlen == 7


def test_unpacked_batch_without_boundaries_is_valid():
    assert validate({"input_ids": torch.ones(2, 7, dtype=torch.long)}) is None
    assert validate({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None]}) is None


BAD = {
    "cu_seqlens not starting at 0": (
        dict(cu_seq_lens_q=torch.tensor([1, 3, 8, 10], dtype=torch.int32), cu_seq_lens_k=None),
        r"'cu_seq_lens_q': expected 0 as the first entry, found 1 in \[1, 3, 8, 10\]\. Fix: start",
    ),
    "decreasing cu_seqlens": (
        dict(cu_seq_lens_q=torch.tensor([0, 8, 3, 10], dtype=torch.int32), cu_seq_lens_k=None),
        r"'cu_seq_lens_q': expected non-decreasing entries, found entry 2 \(3\) < entry 1 \(8\)\. Fix:",
    ),
    "last value != token count": (
        dict(cu_seq_lens_q=torch.tensor([0, 3, 8], dtype=torch.int32), cu_seq_lens_k=None),
        r"'cu_seq_lens_q': expected the batch's token count .*, found 8 for a batch of 10 tokens",
    ),
    "float cu_seqlens": (
        dict(cu_seq_lens_q=torch.tensor([0.0, 3, 8, 10]), cu_seq_lens_k=None),
        r"'cu_seq_lens_q': expected a 1-D int32 \(or int64\) tensor \[N\+1\].*found a tensor of float32, shape \[4\]",
    ),
    "cu_seqlens shaped [1, N+1]": (
        dict(cu_seq_lens_q=torch.tensor([[0, 3, 8, 10]], dtype=torch.int32), cu_seq_lens_k=None),
        r"'cu_seq_lens_q': expected a 1-D .* found a tensor of int32, shape \[1, 4\]",
    ),
    "cu_seqlens as a Python list": (
        dict(cu_seq_lens_q=[0, 3, 8, 10], cu_seq_lens_k=None),
        r"'cu_seq_lens_q': expected a 1-D .* found a list\. Fix: build it as torch\.tensor",
    ),
    "cu_seq_lens_q != cu_seq_lens_k": (
        dict(cu_seq_lens_k=torch.tensor([0, 4, 8, 10], dtype=torch.int32)),
        r"'cu_seq_lens_k': expected the same values as 'cu_seq_lens_q'.*found \[0, 4, 8, 10\] next to",
    ),
    "max_length smaller than the longest document": (
        dict(max_length_q=4),
        r"'max_length_q': expected a Python int >= the longest document.*found 4 with a document of 5 tokens",
    ),
    "max_length as a float": (
        dict(max_length_q=5.0),
        r"'max_length_q': expected a Python int .* found a float",
    ),
    "seq_idx of the wrong length": (
        dict(seq_idx=torch.zeros(1, 9, dtype=torch.int32)),
        r"'seq_idx': expected an int32 \(or int64\) tensor shaped like input_ids"
        r".*found a tensor of int32, shape \[1, 9\]",
    ),
    "seq_idx inconsistent with cu_seqlens": (
        dict(seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2]], dtype=torch.int32)),
        r"'seq_idx': expected document starts at the same tokens as 'cu_seq_lens_q', found a document that does not "
        r"start at row 0, token 3 in 'seq_idx' but does in 'cu_seq_lens_q'",
    ),
    "attention_mask together with boundaries": (
        dict(attention_mask=torch.ones(1, 10, dtype=torch.long)),
        r"'attention_mask': expected no padding mask in a batch with boundary kwargs.*Fix: drop 'attention_mask'",
    ),
    "seq_idx without cu_seqlens": (
        dict(cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None),
        r"'cu_seq_lens_q': expected present whenever a batch carries boundary kwargs.*found no 'cu_seq_lens_q'",
    ),
    "position_ids that do not restart": (
        dict(position_ids=torch.arange(10)[None]),
        r"'position_ids': expected positions counting from the same start inside every document.*found position 3 at "
        r"token 3 \(document 1, tokens 3:8\), where 0 was expected",
    ),
    "labels that predict across documents": (
        dict(labels=torch.arange(1, 11)[None]),
        r"'labels': expected -100 at every document start.*found 4 at the document start at token 3",
    ),
    "boundaries of a different batch": (
        dict(input_ids=torch.ones(1, 12, dtype=torch.long), seq_idx=None),
        r"found 10 for a batch of 12 tokens",
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
    per_token = ("input_ids", "labels", "position_ids", "seq_idx")
    batch = {k: (v.view(2, 5) if k in per_token else v) for k, v in batch.items()}
    with pytest.raises(BoundaryError,
                       match=r"found document 1 \(tokens 3:8\) crossing the row edge at token 5 \(rows of 5\)"):
        validate(batch)


def test_packed_rows_without_boundaries_are_refused():
    batch = _batch()
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
        batch.pop(key)
    with pytest.raises(BoundaryError, match=r"'position_ids': .*never infers.*found a restart at row 0, token 3"):
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
    with pytest.raises(BoundaryError, match="expected 0 as the first entry"):
        collate([[1, 2, 3], [4, 5]])


def test_validation_never_runs_inside_the_model(monkeypatch):
    """Checks live on the host: a patched forward neither calls validate nor adds a guard for it."""
    import compilepack.batch.validation as validate_module
    from compilepack.patching import family_named
    from tests.models import build_pair

    def fail(*args, **kwargs):
        raise AssertionError("validate ran inside the model")

    monkeypatch.setattr(validate_module, "validate", fail)
    monkeypatch.setattr(compilepack, "validate", fail)
    _, patched = build_pair(family_named("llama"))
    patched(**_batch())
