"""``compilepack::selective_scan_varlen``: the Mamba1 selective scan with document resets.

Tolerances: the exactness tests run in float64, where the packed scan and each document scanned alone agree
to 5e-15 (outputs) and 3e-13 (dA, a sum over every token) absolute, measured on 9 documents of 1-300 tokens;
the blocked scan only reassociates the recurrence's products and sums. 1e-9 absolute leaves room. Comparisons
with transformers' torch scan (one step per token, float32) are relative to the largest magnitude of the tensor
compared, because outputs and gradients are sums of exponentially weighted products whose size grows with the
document length: a fixed absolute bound would be loose on small values or fail on large ones. Measured on 512
tokens in 6 documents: float32 op vs float32 stock 0.6-1.7e-7 relative, each of them 0.6-2e-7 off the float64
op; we allow 1e-5.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compilepack import backends
from compilepack.ops.selective_scan import selective_scan_varlen
from tests.compiling import graphs_compiled
from tests.strategies import doc_lengths, seq_idx_of

transformers = pytest.importorskip("transformers")
from transformers.models.mamba import modeling_mamba  # noqa: E402

STOCK_SCAN = inspect.unwrap(modeling_mamba.mamba_selective_scan)  # the torch fallback itself (no kernel lookup)

DIM, STATE, GROUPS = 8, 4, 2
F64_ATOL = 1e-9
REL_TOL = 1e-5
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def _inputs(total, dtype=torch.float64, batch=1, groups=None, seed=0, grad=True):
    """``(u, delta, A, B, C, D, z, delta_bias)``; B/C ``[b, N, T]`` (groups=None) or ``[b, G, N, T]``; u, z, B, C
    channel-last (transposes of ``[b, T, ...]``) as transformers passes them."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    channel_last = lambda *rows: randn(batch, total, *rows).movedim(1, -1)  # noqa: E731
    u, z = channel_last(DIM), channel_last(DIM)
    delta = randn(batch, DIM, total)
    A = -torch.rand(DIM, STATE, generator=gen, dtype=dtype) * 2 - 0.05
    B, C = (channel_last(STATE) if groups is None else channel_last(groups, STATE) for _ in range(2))
    D, delta_bias = randn(DIM), randn(DIM) * 0.5
    return [t.requires_grad_(grad) for t in (u, delta, A, B, C, D, z, delta_bias)]


def _run(fn, tensors, grad_out):
    """Output and the gradient of every input, for ``fn(*tensors)``."""
    out = fn(*tensors)
    grads = torch.autograd.grad(out, tensors, grad_out)
    return out.detach(), grads


def _packed(seq_idx):
    def fn(u, delta, A, B, C, D, z, delta_bias):
        return selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, True, seq_idx)
    return fn


def _alone(u, delta, A, B, C, D, z, delta_bias):
    """The op on rows that are one document each (seq_idx all zeros)."""
    seq_idx = torch.zeros(u.shape[0], u.shape[2], dtype=torch.int32)
    return _packed(seq_idx)(u, delta, A, B, C, D, z, delta_bias)


def _stock(u, delta, A, B, C, D, z, delta_bias):
    return STOCK_SCAN(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True)


def _per_document(scan_one, lengths):
    """``scan_one`` on each document alone (time slices of u, delta, B, C, z), concatenated along time."""
    def fn(u, delta, A, B, C, D, z, delta_bias):
        outs, start = [], 0
        for length in lengths:
            piece = (..., slice(start, start + length))
            outs.append(scan_one(u[piece], delta[piece], A, B[piece], C[piece], D, z[piece], delta_bias))
            start += length
        return torch.cat(outs, dim=-1)
    return fn


def _documents_as_rows(lengths):
    """Each document alone, all in one call: row i holds document i from position 0, right-padded. Padding
    comes after the document (causal: it cannot change the document's outputs) and gets zero output gradient
    (so it adds nothing to any gradient); each row is one document."""
    longest = max(lengths)
    index = torch.zeros(len(lengths), longest, dtype=torch.long)  # packed position of each (row, slot)
    valid = torch.zeros(len(lengths), longest, dtype=torch.bool)
    start = 0
    for row, length in enumerate(lengths):
        index[row, :length] = torch.arange(start, start + length)
        valid[row, :length] = True
        start += length

    def to_rows(t):  # [1, ..., T] -> [docs, ..., longest]
        rows = t[0].movedim(-1, 0)[index] * valid.view(*valid.shape, *[1] * (t.dim() - 2))
        return rows.movedim(1, -1)

    def fn(u, delta, A, B, C, D, z, delta_bias):
        rows = _alone(to_rows(u), to_rows(delta), A, to_rows(B), to_rows(C), D, to_rows(z), delta_bias)
        return rows.movedim(-1, 1)[valid].T[None]  # rows back to the packed order, [1, D, T]

    return fn


def _assert_close_rel(actual, expected, tol=REL_TOL, what=""):
    scale = expected.abs().max().clamp_min(1e-30)
    error = (actual.to(expected.dtype) - expected).abs().max() / scale
    assert error <= tol, f"{what}: relative error {error:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------------------------- exactness


@given(lengths=doc_lengths(), groups=st.sampled_from([None, 1, GROUPS]))
def test_packed_equals_documents_alone(lengths, groups):
    total = sum(lengths)
    tensors = _inputs(total, groups=groups)
    grad_out = torch.randn(1, DIM, total, dtype=torch.float64)
    packed, packed_grads = _run(_packed(seq_idx_of(lengths)), tensors, grad_out)
    alone, alone_grads = _run(_documents_as_rows(lengths), tensors, grad_out)
    torch.testing.assert_close(packed, alone, atol=F64_ATOL, rtol=0)
    for name, got, want in zip(NAMES, packed_grads, alone_grads):
        torch.testing.assert_close(got, want, atol=F64_ATOL, rtol=0, msg=lambda m: f"grad {name}: {m}")


def test_documents_as_rows_is_a_faithful_reference():
    """The batched per-document reference above equals a plain loop over documents."""
    lengths = [5, 70, 1, 64, 20]
    tensors = _inputs(sum(lengths), groups=GROUPS)
    grad_out = torch.randn(1, DIM, sum(lengths), dtype=torch.float64)
    rows, rows_grads = _run(_documents_as_rows(lengths), tensors, grad_out)
    loop, loop_grads = _run(_per_document(_alone, lengths), tensors, grad_out)
    torch.testing.assert_close(rows, loop, atol=F64_ATOL, rtol=0)
    for got, want in zip(rows_grads, loop_grads):
        torch.testing.assert_close(got, want, atol=F64_ATOL, rtol=0)


PER_TOKEN, SHARED = (0, 1, 3, 4, 6), (2, 5, 7)  # u, delta, B, C, z carry a batch dim; A, D, delta_bias do not


def test_batch_rows_are_independent():
    """Two rows packed differently: each row equals its documents alone, gradients included (the shared
    parameters' gradients are the sum over rows)."""
    lengths_per_row = [[70, 1, 57], [3, 125]]
    tensors = _inputs(128, batch=2, groups=GROUPS)
    seq_idx = torch.cat([seq_idx_of(lengths) for lengths in lengths_per_row])
    grad_out = torch.randn(2, DIM, 128, dtype=torch.float64)
    out, grads = _run(_packed(seq_idx), tensors, grad_out)
    shared_grads = {i: torch.zeros_like(tensors[i]) for i in SHARED}
    for row, lengths in enumerate(lengths_per_row):
        row_tensors = [(t[row : row + 1] if i in PER_TOKEN else t).detach().requires_grad_()
                       for i, t in enumerate(tensors)]
        alone, alone_grads = _run(_documents_as_rows(lengths), row_tensors, grad_out[row : row + 1])
        torch.testing.assert_close(out[row : row + 1], alone, atol=F64_ATOL, rtol=0)
        for i in PER_TOKEN:
            torch.testing.assert_close(grads[i][row : row + 1], alone_grads[i], atol=F64_ATOL, rtol=0)
        for i in SHARED:
            shared_grads[i] += alone_grads[i]
    for i in SHARED:
        torch.testing.assert_close(grads[i], shared_grads[i], atol=F64_ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------- vs transformers


def test_stock_leaks_across_documents_and_the_op_does_not():
    lengths = [50, 80, 30]
    tensors = _inputs(sum(lengths), dtype=torch.float32, grad=False)
    stock_packed = _stock(*tensors)
    per_doc = _per_document(_stock, lengths)(*tensors)
    ours = _packed(seq_idx_of(lengths))(*tensors)
    first = slice(0, lengths[0])
    torch.testing.assert_close(stock_packed[..., first], per_doc[..., first])  # the first document cannot leak
    assert (stock_packed[..., lengths[0]:] - per_doc[..., lengths[0]:]).abs().max() > 1e-2
    _assert_close_rel(ours, per_doc)


def test_packed_matches_stock_per_document_float32():
    """Against transformers itself: the packed op equals the stock scan run on each document alone."""
    lengths = [100, 1, 64, 200, 17, 130]
    tensors = _inputs(sum(lengths), dtype=torch.float32)
    grad_out = torch.randn(1, DIM, sum(lengths))
    packed, packed_grads = _run(_packed(seq_idx_of(lengths)), tensors, grad_out)
    stock, stock_grads = _run(_per_document(_stock, lengths), tensors, grad_out)
    _assert_close_rel(packed, stock, what="out")
    for name, got, want in zip(NAMES, packed_grads, stock_grads):
        _assert_close_rel(got, want, what=f"grad {name}")


@pytest.mark.parametrize("total", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("optional", ["all", "none"])
def test_single_document_equals_stock(total, optional):
    """On one document (what a patched model sees for unpacked rows) the op is transformers' scan, with and
    without the optional D / z / delta_bias / softplus."""
    u, delta, A, B, C, D, z, delta_bias = _inputs(total, dtype=torch.float32, seed=total)
    if optional == "none":
        with torch.no_grad():
            delta.abs_()  # without softplus dt must already be positive
        tensors = [u, delta, A, B, C]
        ours_fn = lambda *t: selective_scan_varlen(*t, seq_idx=torch.zeros(1, total, dtype=torch.int32))  # noqa
        stock_fn = STOCK_SCAN
    else:
        tensors = [u, delta, A, B, C, D, z, delta_bias]
        ours_fn, stock_fn = _alone, _stock
    grad_out = torch.randn(1, DIM, total)
    ours, ours_grads = _run(ours_fn, tensors, grad_out)
    stock, stock_grads = _run(stock_fn, tensors, grad_out)
    assert ours.dtype == stock.dtype == torch.float32
    _assert_close_rel(ours, stock, what="out")
    for name, got, want in zip(NAMES, ours_grads, stock_grads):
        _assert_close_rel(got, want, what=f"grad {name}")


def test_low_precision_inputs_compute_in_float32():
    u, delta, A, B, C, D, z, delta_bias = (t.to(torch.bfloat16) for t in _inputs(40, grad=False))
    seq_idx = seq_idx_of([10, 30])
    out = selective_scan_varlen(u, delta, A.float(), B, C, D.float(), z, delta_bias.float(), True, seq_idx)
    assert out.dtype == torch.float32 and out.shape == u.shape
    stock = _stock(*(t[..., 10:].float() if t.dim() == 3 else t.float()
                     for t in (u, delta, A, B, C, D, z, delta_bias)))
    _assert_close_rel(out[..., 10:], stock, tol=1e-6)  # the same float32 math on bf16 values
    leaves = [t.requires_grad_() for t in (u, delta, B, C, z)]
    out = selective_scan_varlen(leaves[0], leaves[1], A.float(), leaves[2], leaves[3], z=leaves[4],
                                seq_idx=seq_idx)
    grads = torch.autograd.grad(out.sum(), leaves)
    assert all(g.dtype == torch.bfloat16 and g.shape == t.shape for g, t in zip(grads, leaves))


# ----------------------------------------------------------------------------------------------- op contract


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("lengths,groups", [([1], None), ([30, 1, 33, 64, 64, 5], GROUPS)])
def test_opcheck_forward_and_backward(lengths, groups):
    total = sum(lengths)
    u, delta, A, B, C, D, z, delta_bias = _inputs(total, dtype=torch.float32, groups=groups or 1)
    seq_idx = seq_idx_of(lengths)
    args = (u, delta, A, B, C, seq_idx, D, z, delta_bias, True, backends.REFERENCE)
    op = torch.ops.compilepack.selective_scan_varlen.default
    torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)
    if len(lengths) > 1:  # optional D / z / delta_bias absent, once
        torch.library.opcheck(op, (u, delta, A, B, C, seq_idx, None, None, None, False, backends.REFERENCE),
                              test_utils=OPCHECK_TESTS)
    with torch.no_grad():
        out, saved = op(*args)
    detached = [t.detach() for t in (u, delta, A, B, C)]
    backward_args = (torch.randn_like(out), saved, *detached, seq_idx, D.detach(), z.detach(),
                     delta_bias.detach(), True, backends.REFERENCE)
    torch.library.opcheck(torch.ops.compilepack.selective_scan_varlen_backward.default, backward_args,
                          test_utils=OPCHECK_TESTS)


def _scan_loss(u, delta, A, B, C, D, z, delta_bias, seq_idx):
    out = selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, True, seq_idx)
    return (out * out).sum()


def test_explain_one_graph_no_breaks():
    tensors = _inputs(70, dtype=torch.float32)
    seq_idx = seq_idx_of([20, 50])
    forward = torch._dynamo.explain(_scan_loss)(*tensors, seq_idx)
    assert (forward.graph_count, forward.graph_break_count) == (1, 0)
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # lets dynamo trace .backward() itself
        backward = torch._dynamo.explain(lambda *a: _scan_loss(*a).backward())(*tensors, seq_idx)
    assert (backward.graph_count, backward.graph_break_count) == (1, 0)


def test_compiles_once_across_lengths_and_packings():
    # aot_eager, not a bare counter: fakes and saved-tensor shapes are traced, so a stride or size mismatch
    # between fake and real, or a specialised block count, would show up here
    compiled = torch.compile(_scan_loss, fullgraph=True, dynamic=True, backend="aot_eager")
    packings = [[40], [10, 30, 3], [1] * 9, [100, 28], [64, 1, 64], [7, 70, 7, 7]]
    with graphs_compiled() as compiles:
        for lengths in packings:
            tensors = _inputs(sum(lengths), dtype=torch.float32)
            loss = compiled(*tensors, seq_idx_of(lengths))
            loss.backward()
        assert compiles() == 1


def test_aot_eager_forward_backward_matches_eager():
    lengths = [33, 1, 60]
    seq_idx = seq_idx_of(lengths)
    tensors = _inputs(sum(lengths), dtype=torch.float32, groups=GROUPS)
    compiled = torch.compile(_scan_loss, backend="aot_eager", fullgraph=True, dynamic=True)
    got = torch.autograd.grad(compiled(*tensors, seq_idx), tensors)
    want = torch.autograd.grad(_scan_loss(*tensors, seq_idx), tensors)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"grad {name}: {m}")


# ----------------------------------------------------------------------------------------------- CUDA path


def test_kernel_backend_runs_the_reference_and_loads_no_library(monkeypatch):
    """No library resets the selective scan inside a row (mamba-ssm 2.3.2.post1), so a CUDA tensor with
    backend="mamba_ssm" must run the reference, not reach for selective_scan_cuda. Driven on CPU by making
    every tensor look like a kernel tensor and every library load fail."""
    lengths = [20, 1, 43]
    tensors = _inputs(sum(lengths), dtype=torch.float32)
    grad_out = torch.randn(1, DIM, sum(lengths))
    want, want_grads = _run(_packed(seq_idx_of(lengths)), tensors, grad_out)

    def no_library(name):
        raise AssertionError(f"selective_scan_varlen loaded {name}")

    monkeypatch.setattr(backends, "use_kernel", lambda tensor, backend: True)
    monkeypatch.setattr(backends, "load", no_library)
    scan = lambda *t: selective_scan_varlen(*t[:8], True, seq_idx_of(lengths), backend="mamba_ssm")  # noqa
    got, got_grads = _run(scan, tensors, grad_out)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- errors


def _bad(argument, **changes):
    u, delta, A, B, C, D, z, delta_bias = _inputs(10, dtype=torch.float32, grad=False)
    kwargs = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
                  seq_idx=torch.zeros(1, 10, dtype=torch.int32))
    kwargs.update(changes)
    return pytest.param(kwargs, argument, id=argument)


def _shapes():
    u, delta, A, B, C, D, z, delta_bias = _inputs(10, dtype=torch.float32, grad=False)
    return [
        _bad("u", u=u[0]),
        _bad("delta", delta=delta[..., :9]),
        _bad("A", A=A[:5]),
        _bad("B", B=B[..., :9]),
        _bad("B", B=torch.randn(1, 3, STATE, 10)),  # 3 groups do not divide 8 channels
        _bad("C", C=C[:, :2]),
        _bad("D", D=D[:3]),
        _bad("z", z=z[..., :9]),
        _bad("delta_bias", delta_bias=delta_bias[:2]),
        _bad("seq_idx", seq_idx=torch.zeros(1, 9, dtype=torch.int32)),
        _bad("seq_idx", seq_idx=torch.zeros(1, 10)),
        _bad("seq_idx", seq_idx=None),
    ]


@pytest.mark.parametrize("kwargs,argument", _shapes())
def test_shape_errors_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=rf"selective_scan_varlen: {argument}"):
        selective_scan_varlen(**kwargs)
