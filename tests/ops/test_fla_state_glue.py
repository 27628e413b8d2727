"""The glue between the sequence mode's one state per row and fla's one state per document
(``ops/_delta_rule/fla.py``), on the layouts a rank's slice gives (empty documents before, between and after, two
rows): each row's first and last token found in the right document, states placed and read back there. The fla
kernels themselves run in the kernel stage (``tests/kernels/test_state_kernels.py``)."""

from __future__ import annotations

import torch

from compilepack.ops._delta_rule import fla as _fla
from tests.strategies import cu_seqlens_of

# (document lengths, rows, first document of each row, last document of each row)
LAYOUTS = [
    ([0, 0, 70, 1, 0, 57, 0], 1, [2], [5]),  # empty documents before, between and after
    ([10, 22, 0, 1, 15, 16, 0], 2, [0, 3], [1, 5]),  # row 1 opens with an empty document, ends with one
    ([0, 50, 0], 1, [1], [1]),  # the slice inside one document
]


def test_row_documents_skip_empty_documents():
    for lengths, rows, first, last in LAYOUTS:
        cu = cu_seqlens_of(lengths)
        got_first, got_last = _fla.row_documents(cu, rows, sum(lengths) // rows)
        assert got_first.tolist() == first and got_last.tolist() == last, lengths
    # control: searching from the left lands on the empty documents before the row's first token
    cu = cu_seqlens_of(LAYOUTS[0][0])
    assert int(torch.searchsorted(cu, torch.tensor([0], dtype=cu.dtype)) - 1) != LAYOUTS[0][2][0]


def test_document_states_round_trip():
    lengths, rows, first, last = LAYOUTS[1]
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(rows, 2, 3, 4, generator=generator)
    per_document = _fla.document_states(states, torch.tensor(first), len(lengths))
    assert torch.equal(per_document[first], states)
    others = [i for i in range(len(lengths)) if i not in first]
    assert not per_document[others].any()  # every other document starts from zero
    assert torch.equal(per_document.index_select(0, torch.tensor(first)), states)  # read back as state_path does
