"""compilepack::selective_scan_varlen: packed == the naive per-document recurrence, equal to transformers on one
document, exact fp64 gradients (gradcheck), documents isolated to the bit, one graph under torch.compile, and no
kernel library ever loaded (none can reset the scan inside a row).

Tolerances: the op computes in fp32 (as transformers' torch scan does). Outputs and gradients are compared with an
absolute bound of 1e-5 scaled by the largest magnitude of the reference tensor (at least 1): outputs and gradients
are sums of exponentially weighted products whose size grows with the document length, and so does their fp32
error. Measured against the fp64 oracle over 60 hypothesis packings: <= 4e-7 of the largest entry for the output
and the per-token gradients, 1.3e-6 for dA (a sum over every token); boundaries dropped: 0.27, 2.7e4 times the
tolerance.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.mamba import modeling_mamba

from compilepack.ops import backends
from compilepack.ops import selective_scan as scan
from compilepack.ops.selective_scan import selective_scan_naive, selective_scan_varlen
from tests.ops import contract
from tests.ops.fakes import route_kernels
from tests.ops.oracle import OpChecks, output_and_grads, output_and_random_grads, run_fp64
from tests.ops.properties import assert_close, assert_packing_isolated, at_least_two_documents, gradcheck, max_error
from tests.strategies import doc_lengths, seq_idx_of

STOCK_SCAN = inspect.unwrap(modeling_mamba.mamba_selective_scan)  # the torch fallback itself (no kernel lookup)

DIM, STATE, GROUPS = 8, 4, 2
FP32_TOL = 1e-5
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def make_inputs(total, batch=1, groups=None, seed=0, dtype=torch.float32, dims=(DIM, STATE)):
    """``[u, delta, A, B, C, D, z, delta_bias]`` as transformers passes them: u, z, B, C channel-last (transposes
    of ``[b, T, ...]``); B, C ``[b, N, T]`` (``groups=None``) or ``[b, G, N, T]``."""
    gen = torch.Generator().manual_seed(seed)
    dim, state = dims
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    channel_last = lambda *rows: randn(batch, total, *rows).movedim(1, -1)  # noqa: E731
    u, z = channel_last(dim), channel_last(dim)
    delta = randn(batch, dim, total)
    A = -torch.rand(dim, state, generator=gen) * 2 - 0.05
    B, C = (channel_last(state) if groups is None else channel_last(groups, state) for _ in range(2))
    D, delta_bias = randn(dim), randn(dim) * 0.5
    return [t.to(dtype).requires_grad_() for t in (u, delta, A, B, C, D, z, delta_bias)]


def run_op(inputs, seq_idx, grad_seed=1, **kwargs):
    """Output, the gradient of every input, and the output gradient used (``delta_softplus=True``)."""
    out = selective_scan_varlen(*inputs, True, seq_idx=seq_idx, **kwargs)
    return output_and_random_grads(out, inputs, grad_seed)


def run_naive_fp64(inputs, seq_idx, grad):
    return run_fp64(lambda *x: selective_scan_naive(*x, True, seq_idx=seq_idx), inputs, grad)


def run_stock(inputs, grad):
    u, delta, A, B, C, D, z, delta_bias = inputs
    out = STOCK_SCAN(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True)
    return output_and_grads(out, inputs, grad)


CHECKS = OpChecks(run_op, run_naive_fp64, NAMES, FP32_TOL)
assert_all_close = CHECKS.assert_all_close


# --------------------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------------------


@given(lengths=doc_lengths(max_total=320), groups=st.sampled_from([None, 1, GROUPS]))
def test_packed_equals_naive_recurrence_per_document(lengths, groups):
    CHECKS.assert_equals_oracle(make_inputs(sum(lengths), groups=groups, seed=len(lengths)), seq_idx_of(lengths))


def test_tolerance_catches_dropped_boundaries():
    """The control: the same comparison with the boundaries dropped (one long document) misses by far."""
    lengths = [50, 40, 60]
    inputs = make_inputs(sum(lengths), seed=3)
    CHECKS.assert_tolerance_catches_dropped_boundaries(inputs, seq_idx_of(lengths), seq_idx_of([sum(lengths)]))


@pytest.mark.parametrize("total", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("optional", ["all", "none"])
def test_single_document_equals_stock_function(total, optional):
    """On one document (what a patched model sees for unpacked rows) the op is transformers' scan, with and
    without the optional D / z / delta_bias / softplus."""
    inputs = make_inputs(total, seed=total)
    grad = torch.randn(1, DIM, total)
    seq_idx = torch.zeros(1, total, dtype=torch.int32)
    if optional == "all":
        out, grads, grad = run_op(inputs, seq_idx, grad_seed=total)
        assert_all_close(out, grads, *run_stock(inputs, grad))
        return
    u, delta, A, B, C = inputs[:5]
    with torch.no_grad():
        delta.abs_()  # without softplus dt must already be positive
    out = selective_scan_varlen(u, delta, A, B, C, seq_idx=seq_idx)
    stock = STOCK_SCAN(u, delta, A, B, C)
    assert out.dtype == stock.dtype == torch.float32
    assert_close(out, stock, "output", FP32_TOL)
    for name, got, ref in zip(NAMES, torch.autograd.grad(out, inputs[:5], grad),
                              torch.autograd.grad(stock, inputs[:5], grad)):
        assert_close(got, ref, f"d{name}", FP32_TOL)


def test_stock_function_leaks_across_documents():
    """What the op fixes: the stock function on a packed row mixes later documents with the first, while the op
    equals the stock function run on each document alone."""
    lengths = [50, 80, 30]
    inputs = make_inputs(sum(lengths))
    grad = torch.randn(1, DIM, sum(lengths))
    stock, _ = run_stock(inputs, grad)
    ref, _ = run_naive_fp64(inputs, seq_idx_of(lengths), grad)
    assert max_error(stock[..., 50:], ref[..., 50:]) > 1e-2
    start, per_document = 0, []
    for length in lengths:
        pieces = [x[..., start : start + length] if x.dim() == 3 else x for x in inputs]
        per_document.append(STOCK_SCAN(*pieces[:5], D=pieces[5], z=pieces[6], delta_bias=pieces[7],
                                       delta_softplus=True).detach())
        start += length
    out, _, _ = run_op(inputs, seq_idx_of(lengths))
    assert_close(out, torch.cat(per_document, dim=-1), "output", FP32_TOL)


def test_batch_rows_are_documents():
    """Two rows packed differently: each row's documents restart at the row start and at their own starts."""
    seq_idx = torch.cat([seq_idx_of([70, 1, 57]), seq_idx_of([3, 125])])
    CHECKS.assert_equals_oracle(make_inputs(128, batch=2, groups=GROUPS, seed=4), seq_idx)


def test_zero_length_documents_change_nothing():
    """Skipped document indices (empty documents) and int64 indices give the same bits."""
    others = (seq_idx_of([0, 30, 0, 0, 70, 0]), seq_idx_of([30, 70]).long())
    CHECKS.assert_same_bits(make_inputs(100), seq_idx_of([30, 70]), *others)


@pytest.mark.parametrize("batch, total, optional", [(2, 10, False), (2, 70, True), (1, 64, False)])
def test_output_is_the_transpose_of_a_contiguous_row_major_tensor(batch, total, optional):
    """``[b, D, T]`` with the strides of ``[b, T, D]`` transposed, also when T is not a whole number of blocks
    and there is neither skip nor gate (the output is then the scan's own, block-padded, buffer)."""
    u, delta, A, B, C, D, z, delta_bias = make_inputs(total, batch=batch)
    extra = dict(D=D, z=z, delta_bias=delta_bias) if optional else {}
    out = selective_scan_varlen(u, delta, A, B, C, seq_idx=torch.zeros(batch, total, dtype=torch.int32), **extra)
    assert out.shape == (batch, DIM, total) and out.stride() == (total * DIM, 1, DIM)


def test_bfloat16_inputs_compute_in_float32():
    """bf16 inputs: the output is float32 (as transformers' torch scan returns it), the gradients keep each
    input's dtype, and the values are the fp32 math on the bf16 values."""
    inputs = make_inputs(80, seed=5)
    inputs = [x.detach().to(torch.bfloat16 if x.dim() > 1 else torch.float32).requires_grad_() for x in inputs]
    inputs[2] = inputs[2].detach().float().requires_grad_()  # A is a float32 parameter in the models
    seq_idx = seq_idx_of([20, 60])
    out, grads, grad = run_op(inputs, seq_idx)
    assert out.dtype == torch.float32 and out.shape == (1, DIM, 80)
    assert [g.dtype for g in grads] == [x.dtype for x in inputs]
    assert_close(out, run_naive_fp64(inputs, seq_idx, grad)[0], "output", FP32_TOL)


def test_autocast_bfloat16_forward_and_backward():
    """Under CPU autocast the op computes in fp32 inside (autocast is off in custom-op bodies)."""
    CHECKS.assert_autocast_computes_in_fp32(make_inputs(70, groups=GROUPS, seed=7), seq_idx_of([20, 50]))


# --------------------------------------------------------------------------------------------------------------
# Exactness: fp64 gradcheck and bit-exact document isolation
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 tokens: fp64 gradcheck costs a forward per input entry, so with few tokens the checks still
    cross many block edges and run the carry between blocks (3 blocks at least), as 64-token blocks would need
    hundreds of tokens for."""
    monkeypatch.setattr(scan.reference, "BLOCK", 4)


@pytest.mark.parametrize(
    "lengths", [[9, 1, 14], [3, 9, 2], [7, 1, 4, 4]],
    ids=["several+1-token", "crosses-block-edges", "1-token-ends-block+block-start"],
)
def test_fp64_gradcheck(small_blocks, lengths):
    inputs = make_inputs(sum(lengths), seed=11, dims=(2, 2))
    seq_idx = seq_idx_of(lengths)
    assert gradcheck(lambda *x: selective_scan_varlen(*x, True, seq_idx=seq_idx), inputs)


def test_fp64_gradcheck_groups_two_rows_no_softplus(small_blocks):
    inputs = make_inputs(9, batch=2, groups=2, seed=12, dims=(2, 1))
    seq_idx = torch.cat([seq_idx_of([5, 4]), seq_idx_of([1, 8])])
    with torch.no_grad():
        inputs[7].abs_().add_(3.0)  # without softplus dt + bias must stay positive
    assert gradcheck(lambda *x: selective_scan_varlen(*x, seq_idx=seq_idx), inputs)


TOKEN_DIMS = (2, 2, None, -1, -1, None, 2, None)  # u, delta, z: dim 2; B, C: the last dim; A, D, delta_bias: none


@given(lengths=doc_lengths(max_total=200), groups=st.sampled_from([None, GROUPS]))
def test_documents_isolated_to_the_bit(lengths, groups):
    """Another document's values change neither this document's output nor reach its gradients, in any bit."""
    lengths = at_least_two_documents(lengths)
    seq_idx = seq_idx_of(lengths)
    run = lambda x: selective_scan_varlen(*x, True, seq_idx=seq_idx)  # noqa: E731
    assert_packing_isolated(run, lambda seed: make_inputs(sum(lengths), groups=groups, seed=seed), lengths,
                            TOKEN_DIMS, 2)


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


def op_args(inputs, seq_idx, optional=True, backend="reference"):
    u, delta, A, B, C, D, z, delta_bias = inputs
    B, C = (t.unsqueeze(1) if t.dim() == 3 else t for t in (B, C))
    if not optional:
        D = z = delta_bias = None
    return (u, delta, A, B, C, seq_idx, D, z, delta_bias, optional, backend)


# the compile tests trace with dynamic shapes; a static-shape trace of the same op adds time, not coverage
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize(
    "lengths, batch, groups, optional",
    [([1], 1, None, True), ([30, 1, 33, 64, 64, 5], 1, GROUPS, True), ([10, 60], 2, None, False)],
)
def test_opcheck(lengths, batch, groups, optional):
    inputs = make_inputs(sum(lengths), batch=batch, groups=groups, seed=2)
    args = op_args(inputs, seq_idx_of(lengths).expand(batch, -1).contiguous(), optional)
    contract.opcheck_forward_and_backward(scan.OP, args, [True] * 5 + [optional] * 3, test_utils=OPCHECK_TESTS)


def loss_of(u, delta, A, B, C, D, z, delta_bias, seq_idx):
    return selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, True, seq_idx=seq_idx).square().sum()


def grads_of(*args):
    return torch.autograd.grad(loss_of(*args), args[:8])


def test_explain_one_graph_no_breaks():
    contract.assert_one_graph(loss_of, grads_of, (*make_inputs(70), seq_idx_of([20, 50])))


def test_compiles_once_across_lengths_and_packings():
    # aot_eager, not a bare counter: fakes and saved-tensor shapes are traced, so a stride or size mismatch
    # between fake and real, or a specialised block count, would show up here
    packings = [[40], [10, 30, 3], [1] * 9, [100, 28], [64, 1, 64], [7, 70, 7, 7]]
    calls = ((*make_inputs(sum(lengths), seed=i), seq_idx_of(lengths)) for i, lengths in enumerate(packings))
    contract.assert_compiles_once(loss_of, calls, backward=True)


def test_aot_eager_backward_matches_eager():
    lengths = [33, 1, 60]
    inputs = make_inputs(sum(lengths), groups=GROUPS)
    contract.assert_aot_eager_grads_equal_eager(loss_of, inputs, [seq_idx_of(lengths)], NAMES)


# --------------------------------------------------------------------------------------------------------------
# CUDA: no library can reset the scan inside a row, so the reference runs whatever the backend
# --------------------------------------------------------------------------------------------------------------


def test_no_kernel_backend_is_declared_and_mamba_ssm_is_refused_by_name(monkeypatch):
    """The reference is the op's only backend (mamba-ssm 2.3.2.post1's selective_scan_cuda takes no seq_idx): patch()
    never chooses a library for it, even where mamba-ssm serves the Mamba2 scan, and asking for one is refused
    before any compute rather than silently running the reference."""
    assert backends.candidates("selective_scan_varlen") == (backends.REFERENCE,)
    assert backends.resolve({"ssd": backends.REFERENCE}, ops=("selective_scan_varlen",)) == backends.Backends()
    loaded = route_kernels(monkeypatch, "mamba_ssm", {})  # any load fails
    inputs, seq_idx = make_inputs(12), seq_idx_of([5, 7])
    with pytest.raises(ValueError, match=r"unknown backend 'mamba_ssm'; expected one of \['reference'\]"):
        run_op(inputs, seq_idx, backend="mamba_ssm")
    assert loaded == []


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'mamba'"):
        selective_scan_varlen(*make_inputs(10), seq_idx=seq_idx_of([10]), backend="mamba")


# --------------------------------------------------------------------------------------------------------------
# Errors checkable from shapes and dtypes
# --------------------------------------------------------------------------------------------------------------


def _shape_errors():
    u, delta, A, B, C, D, z, delta_bias = (x.detach() for x in make_inputs(10))
    cases = [
        (dict(u=u[0]), "u must be [b, D, T], got (8, 10)"),
        (dict(delta=delta[..., :9]), "delta must be [b, D, T] = (1, 8, 10), got (1, 8, 9)"),
        (dict(A=A[:5]), "A must be [D, N] with D = 8 (a real tensor; time-invariant complex A is not supported), "
                        "got (5, 4)"),
        (dict(B=B[..., :9]), "B must be [b, N, T] or [b, G, N, T] with b, N, T = (1, 4, 10) and D = 8 a multiple "
                             "of G (time-invariant [D, N] B is not supported), got (1, 4, 9)"),
        (dict(B=torch.randn(1, 3, STATE, 10)), "B must be [b, N, T] or [b, G, N, T] with b, N, T = (1, 4, 10) and "
                                               "D = 8 a multiple of G (time-invariant [D, N] B is not supported), "
                                               "got (1, 3, 4, 10)"),
        (dict(C=C[:, :2]), "C must be the shape of B (1, 4, 10), got (1, 2, 10)"),
        (dict(D=D[:3]), "D must be [D] = (8,), got (3,)"),
        (dict(z=z[..., :9]), "z must be [b, D, T] = (1, 8, 10), got (1, 8, 9)"),
        (dict(delta_bias=delta_bias[:2]), "delta_bias must be [D] = (8,), got (2,)"),
        (dict(seq_idx=torch.zeros(1, 9, dtype=torch.int32)), "seq_idx must be [b, T] = (1, 10), got (1, 9)"),
        (dict(seq_idx=torch.zeros(1, 10)), "seq_idx must be an int32 (or int64) tensor of document indices, got "
                                           "torch.float32"),
        (dict(seq_idx=None), "seq_idx must be an int32 (or int64) tensor of document indices, got None"),
        (dict(u=u.long(), delta=delta.long(), z=z.long()), "u must be a real floating-point tensor, got torch.int64"),
    ]
    base = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
                seq_idx=torch.zeros(1, 10, dtype=torch.int32))
    return [pytest.param({**base, **change}, message, id=message.split(" ")[0]) for change, message in cases]


@pytest.mark.parametrize("kwargs, message", _shape_errors())
def test_shape_errors(kwargs, message):
    with pytest.raises(ValueError) as error:
        selective_scan_varlen(**kwargs)
    assert str(error.value) == f"selective_scan_varlen: {message}."


def test_seq_idx_is_a_required_keyword():
    u, delta, A, B, C = (x.detach() for x in make_inputs(10)[:5])
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'seq_idx'"):
        selective_scan_varlen(u, delta, A, B, C)
