"""Every op refuses boundaries that decrease (``cu_seqlens``, or ``seq_idx`` along a row) before any compute, with
an error naming the op, the argument and where; boundaries that only repeat or skip (empty documents, ids with gaps,
ids restarting in each row) are accepted. The controls show what the check prevents: without it a document id that
comes back silently mixes two documents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compilepack.batch import rules
from compilepack import ops
from compilepack.ops import _scaffold

T = 12
BACK_CU = torch.tensor([0, 6, 4, T], dtype=torch.int32)  # 6 then 4: tokens 4-5 in two documents
BACK_SEQ_IDX = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 0, 2, 2, 2]], dtype=torch.int32)  # document 0 comes back
# for the controls: a one-token document between two that share id 0, so the second is inside the first's
# convolution window (width 4) and SSD chunk (8 tokens)
MIXING_SEQ_IDX = torch.tensor([[0, 0, 0, 1, 0, 0, 0, 2, 2, 2, 2, 2]], dtype=torch.int32)


def _inputs(seed: int, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in shapes]


def _attention(cu):
    q, k, v = _inputs(0, (T, 2, 8), (T, 2, 8), (T, 2, 8))
    return ops.varlen_attention(q, k, v, cu, T)


def _delta_rule(op, per_channel):
    def call(cu):
        q, k, v, g, beta = _inputs(1, (1, T, 2, 8), (1, T, 2, 8), (1, T, 2, 8),
                                   (1, T, 2, 8) if per_channel else (1, T, 2), (1, T, 2))
        return op(q, k, v, F.logsigmoid(g), beta.sigmoid(), cu)
    return call


def _conv(seq_idx, first_changed=False):
    x, w = _inputs(2, (1, 8, T), (8, 4))
    if first_changed:
        x[:, :, :3] += 1.0
    return ops.causal_conv1d_varlen(x, w, None, seq_idx)


def _mamba2(seq_idx, first_changed=False):
    x, dt, A, B, C = _inputs(3, (1, T, 2, 4), (1, T, 2), (2,), (1, T, 1, 4), (1, T, 1, 4))
    if first_changed:
        x[:, :3] += 1.0
    return ops.mamba2_chunk_scan_varlen(x, dt, -A.abs(), B, C, 8, dt_softplus=True, seq_idx=seq_idx)


def _selective_scan(seq_idx):
    u, delta, A, B, C = _inputs(4, (1, 4, T), (1, 4, T), (4, 3), (1, 3, T), (1, 3, T))
    return ops.selective_scan_varlen(u, delta, -A.abs(), B, C, delta_softplus=True, seq_idx=seq_idx)


CALLS = {
    "varlen_attention": ("cu_seqlens", _attention),
    "gated_delta_rule_varlen": ("cu_seqlens", _delta_rule(ops.gated_delta_rule_varlen, per_channel=False)),
    "kimi_delta_attention_varlen": ("cu_seqlens", _delta_rule(ops.kimi_delta_attention_varlen, per_channel=True)),
    "causal_conv1d_varlen": ("seq_idx", _conv),
    "mamba2_chunk_scan_varlen": ("seq_idx", _mamba2),
    "selective_scan_varlen": ("seq_idx", _selective_scan),
}


@pytest.mark.parametrize("op", list(CALLS))
def test_decreasing_boundaries_are_refused_naming_the_op_the_argument_and_where(op):
    argument, call = CALLS[op]
    if argument == "cu_seqlens":
        boundaries, where = BACK_CU, "6 to 4 at index 2"
    else:
        boundaries, where = BACK_SEQ_IDX, "1 to 0 at row 0, index 6"
    with pytest.raises(ValueError, match=rf"^{op}: {argument} must not decrease, but goes from {where}; "):
        call(boundaries)


@pytest.mark.parametrize("op", list(CALLS))
def test_boundaries_that_repeat_or_skip_are_accepted(op):
    argument, call = CALLS[op]
    if argument == "cu_seqlens":  # empty documents repeat an entry, at the ends too
        out = call(torch.tensor([0, 0, 5, 5, 9, T, T], dtype=torch.int32))
    else:  # ids with gaps, as the HF collator numbers them when it skips empty samples
        out = call(torch.tensor([[0, 0, 2, 2, 2, 3, 3, 3, 3, 7, 7, 7]], dtype=torch.int32))
    assert torch.isfinite(out).all()


def test_seq_idx_is_checked_along_each_row_not_across_rows():
    rules.refuse_steps_back("op", "seq_idx", torch.tensor([[0, 0, 1], [0, 1, 1]]))  # restarting in each row
    with pytest.raises(ValueError, match="goes from 1 to 0 at row 1, index 2"):
        rules.refuse_steps_back("op", "seq_idx", torch.tensor([[0, 0, 1], [0, 1, 0]]))


def test_the_host_copy_is_checked_instead_of_the_tensor_it_copies():
    q, k, v = _inputs(0, (T, 2, 8), (T, 2, 8), (T, 2, 8))
    with pytest.raises(ValueError, match="^varlen_attention: cu_seqlens_cpu must not decrease"):
        ops.varlen_attention(q, k, v, torch.tensor([0, 4, 6, T], dtype=torch.int32), T, cu_seqlens_cpu=BACK_CU)


def test_boundaries_off_the_host_are_never_read():
    # a meta tensor cannot be read, as a GPU tensor could not without a sync: the check returns before reading
    rules.refuse_steps_back("op", "seq_idx", BACK_SEQ_IDX.to("meta"))
    with pytest.raises(ValueError, match="must not decrease"):  # the same values on the host are refused
        rules.refuse_steps_back("op", "seq_idx", BACK_SEQ_IDX)


@pytest.mark.parametrize("op", ["causal_conv1d_varlen", "mamba2_chunk_scan_varlen"])
def test_without_the_check_a_returning_document_id_mixes_documents(op, monkeypatch):
    """Tokens 4-6 start a document of their own (the id changed at 3 and at 4), so their outputs must not depend on
    tokens 0-2; with the check off, both ops let them see tokens 0-2, which carry the same id."""
    monkeypatch.setattr(_scaffold, "refuse_steps_back", lambda *args: None)
    _, call = CALLS[op]
    token_dim = 2 if op == "causal_conv1d_varlen" else 1
    base, changed = (call(MIXING_SEQ_IDX, first_changed=flag).narrow(token_dim, 4, 3) for flag in (False, True))
    assert not torch.equal(base, changed)
    # and with ids that only rise the same change leaves those tokens bit for bit alone (the control's control)
    rising = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 3, 3]], dtype=torch.int32)
    base, changed = (call(rising, first_changed=flag).narrow(token_dim, 4, 3) for flag in (False, True))
    assert torch.equal(base, changed)
