"""PackedCollator: the HF collator's keys, best-fit rows, a fixed-shape mode, and nothing dropped."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import compilepack
from compilepack import BoundaryError, PackedCollator
from tests.models import HF_COLLATOR


def _features(lengths, start=1):
    features, token = [], start
    for n in lengths:
        features.append({"input_ids": list(range(token, token + n))})
        token += n
    return features


def _documents(batch):
    """The real (labelled or non-pad) documents of a batch as token lists, in batch order."""
    flat = batch["input_ids"].flatten().tolist()
    cu = batch["cu_seq_lens_q"].tolist()
    return [flat[s:e] for s, e in zip(cu[:-1], cu[1:]) if e > s and flat[s] != 0]


def test_without_max_length_it_matches_the_hf_collator():
    features = _features([5, 1, 9])
    ours, theirs = PackedCollator()(features), HF_COLLATOR(features)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        if isinstance(theirs[key], torch.Tensor):
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
        else:
            assert ours[key] == theirs[key], key


def test_best_fit_decreasing_fills_the_fullest_row_that_fits():
    collate = PackedCollator(10, flatten=False)
    batch = collate(_features([6, 5, 4, 3, 2]))
    rows = batch["input_ids"].tolist()
    cu = batch["cu_seq_lens_q"].tolist()
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    # 6 -> row0; 5 -> row1; 4 fits row0 (free 4) exactly; 3 -> row1 (free 5 -> 2); 2 -> row1 (free 2 -> 0)
    assert lengths == [6, 4, 5, 3, 2]
    assert len(rows) == 2 and all(len(r) == 10 for r in rows)


def test_fixed_shape_batches_have_identical_shapes_and_ints():
    collate = PackedCollator(16, fixed_shape=True, rows=2, max_docs=8)
    batches = [collate(_features(lengths)) for lengths in ([5, 12, 2], [16], [1, 1, 1], [9, 7, 8, 3])]
    for key in batches[0]:
        values = [b[key] for b in batches]
        if isinstance(values[0], torch.Tensor):
            assert len({(tuple(v.shape), v.dtype) for v in values}) == 1, key
        else:
            assert len(set(values)) == 1, key
    first = batches[0]
    assert first["input_ids"].shape == (1, 32) and first["cu_seq_lens_q"].shape == (9,)
    assert first["max_length_q"] == first["max_length_k"] == 16
    cu = first["cu_seq_lens_q"].tolist()
    assert cu[-1] == 32 and cu[-2] == 32  # unused slots repeat the total: zero-length documents
    padding = first["input_ids"].flatten() == 0
    assert (first["labels"].flatten()[padding] == -100).all()


def test_fixed_shape_unflattened_rows():
    batch = PackedCollator(8, fixed_shape=True, rows=3, max_docs=6, flatten=False)(_features([3, 8, 2]))
    assert batch["input_ids"].shape == (3, 8) and batch["seq_idx"].shape == (3, 8)
    compilepack.validate(batch)


@pytest.mark.parametrize(
    "collate, lengths, message",
    [
        (PackedCollator(8), [9], r"sample 0 has 9 tokens, more than max_length=8"),
        (PackedCollator(8, fixed_shape=True, rows=1), [5, 5], r"2 samples \(10 tokens\) do not fit in 1 rows of 8"),
        (PackedCollator(8, fixed_shape=True, rows=2, max_docs=2), [5, 5],
         r"4 documents \(padding included\), more than max_docs=2"),
        (PackedCollator(), [0, 0], "every sample is empty"),
    ],
)
def test_nothing_is_dropped_silently(collate, lengths, message):
    with pytest.raises(BoundaryError, match=message):
        collate(_features(lengths))


def test_padded_samples_are_refused():
    with pytest.raises(BoundaryError, match="sample 0 is padded"):
        PackedCollator()([{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}])


def test_labels_are_kept_and_separated():
    batch = PackedCollator()([{"input_ids": [1, 2, 3], "labels": [-100, 7, 8]},
                              {"input_ids": [4, 5], "labels": [9, 9]}])
    assert batch["labels"].tolist() == [[-100, 7, 8, -100, 9]]


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    fixed=st.booleans(),
    flatten=st.booleans(),
)
def test_every_document_arrives_whole_and_valid(lengths, fixed, flatten):
    rows = -(-sum(lengths) // 40) + 2  # enough rows for best-fit at 40 tokens each
    collate = PackedCollator(40, fixed_shape=fixed, rows=rows if fixed else None, max_docs=64 if fixed else None,
                             flatten=flatten)
    features = _features(lengths)
    batch = collate(features)
    assert sorted(map(tuple, _documents(batch))) == sorted(tuple(f["input_ids"]) for f in features)
    boundaries = compilepack.validate(batch)
    assert boundaries.max_seqlen >= max(lengths)


def test_every_batch_source_matches_the_hf_collator_form_so_alternating_them_compiles_once():
    """dynamo guards on inputs being the same object: a source passing one tensor as both cu_seq_lens_q and
    cu_seq_lens_k compiles again when a batch of the HF collator (two tensors) follows. Every compilepack source
    gives two tensors, so a stream alternating the HF collator, PackedCollator, with_boundaries and the testing
    batches compiles once; shard_batch's shards (a context-parallel model's own stream) give two tensors too."""
    from transformers import DataCollatorWithFlattening

    from compilepack.distributed import ContextParallel, shard_batch
    from compilepack.integrations import with_boundaries
    from compilepack.patching import family_named
    from compilepack.testing import packed_batch
    from tests.families import build_tiny

    sources = {
        "hf": HF_COLLATOR,
        "packed_collator": PackedCollator(),
        "with_boundaries": with_boundaries(DataCollatorWithFlattening()),
        "testing": lambda features: packed_batch([f["input_ids"] for f in features]).batch,
    }
    lengths = [[7, 1, 12], [20, 3], [5, 5, 5, 9], [11, 2, 1, 30], [6, 17]]
    stream = [collate(_features(lengths[i % len(lengths)])) for i in range(8) for collate in sources.values()]
    for name, collate in sources.items():
        batch = collate(_features([4, 6]))
        assert batch["cu_seq_lens_k"] is not batch["cu_seq_lens_q"], name
    shard = shard_batch(HF_COLLATOR(_features([4, 6])), ContextParallel(None, 2, 0), verify=False)
    assert shard["cu_seq_lens_k"] is not shard["cu_seq_lens_q"]
    model = compilepack.patch(build_tiny(family_named("llama")).eval())
    report = compilepack.count_compiles(model, stream, dynamic=True, reset=True)
    assert report.compiles == 1, report.recompile_reasons
