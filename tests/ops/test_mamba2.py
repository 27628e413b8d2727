"""compilepack::mamba2_chunk_scan_varlen: packed == the naive per-document recurrence, equal to transformers on one
document, exact fp64 gradients (gradcheck), documents isolated to the bit, autocast-safe, one graph under
torch.compile, and the mamba-ssm path driven on CPU through a fake mamba-ssm module that checks the argument
contract.

Tolerances: the op computes in fp32 (as transformers does). Outputs and gradients are compared with an absolute
bound of 1e-5 scaled by the largest magnitude of the reference tensor (at least 1): the scan's outputs and
gradients are sums of exponentially weighted products whose size grows with the sequence, so the fp32 error grows
with the entries' size, not with the token count (measured against the fp64 oracle on 60 hypothesis packings:
<= 8e-7 of the largest entry, dA's the largest; boundaries dropped: 0.39). Gradients of bfloat16 inputs are
bfloat16: they are held to one bfloat16 rounding (2**-8) instead (measured: <= 2.5e-3).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compilepack.ops import mamba2
from compilepack.ops.mamba2 import mamba2_chunk_scan_naive, mamba2_chunk_scan_varlen
from compilepack.ops.mamba2.mamba_ssm import SSD_COMBINED
from tests.ops import contract
from tests.ops.fakes import route_kernels
from tests.ops.fakes.mamba_ssm import FakeSSD
from tests.ops.oracle import OpChecks, output_and_grads, output_and_random_grads, run_fp64
from tests.ops.properties import assert_close, assert_packing_isolated, at_least_two_documents, gradcheck, max_error
from tests.strategies import CHUNK, doc_lengths, seq_idx_of

transformers = pytest.importorskip("transformers")
from transformers.models.bamba import modeling_bamba  # noqa: E402

STOCK_SCAN = inspect.unwrap(modeling_bamba.mamba2_chunk_scan)  # the torch fallback itself (no kernel lookup)

H, P, G, N = 4, 8, 2, 8  # two heads per B/C group, so the group mapping is exercised
SCAN_KW = dict(dt_softplus=True, dt_limit=(0.0, 1.5))
FP32_TOL = 1e-5
BF16_TOL = 2**-8  # one bfloat16 rounding
NAMES = "x dt A B C D dt_bias".split()
TOKEN_DIMS = [1, 1, None, 1, 1, None, None]  # x, dt, B, C are per token; A, D, dt_bias are per head


def make_inputs(total, batch=1, seed=0, dtype=torch.float32, groups=G, D_shape="heads", dims=(H, P, N)):
    """``[x, dt, A, B, C, D, dt_bias]`` as leaves; A, D and dt_bias made as Mamba2 makes them (A < 0)."""
    gen = torch.Generator().manual_seed(seed)
    heads, head_dim, state = dims
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    x = randn(batch, total, heads, head_dim)
    dt = randn(batch, total, heads)
    A = -torch.rand(heads, generator=gen) * 2 - 0.1
    B, C = randn(batch, total, groups, state), randn(batch, total, groups, state)
    D = randn(heads) if D_shape == "heads" else randn(heads, head_dim)
    dt_bias = randn(heads) * 0.5
    return [t.to(dtype).requires_grad_() for t in (x, dt, A, B, C, D, dt_bias)]


def scan(inputs, seq_idx, chunk_size=CHUNK, **kwargs):
    x, dt, A, B, C, D, dt_bias = inputs
    return mamba2_chunk_scan_varlen(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, seq_idx=seq_idx,
                                    **(SCAN_KW | kwargs))


def run_op(inputs, seq_idx, chunk_size=CHUNK, grad_seed=1, **kwargs):
    return output_and_random_grads(scan(inputs, seq_idx, chunk_size, **kwargs), inputs, grad_seed)


def run_naive_fp64(inputs, seq_idx, dy, **kwargs):
    def naive(x, dt, A, B, C, D, dt_bias):
        return mamba2_chunk_scan_naive(x, dt, A, B, C, D=D, dt_bias=dt_bias, seq_idx=seq_idx, **(SCAN_KW | kwargs))

    return run_fp64(naive, inputs, dy)


def run_stock(inputs, dy, chunk_size=CHUNK, **kwargs):
    x, dt, A, B, C, D, dt_bias = inputs
    y = STOCK_SCAN(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, **(SCAN_KW | kwargs))
    return output_and_grads(y, inputs, dy)


CHECKS = OpChecks(run_op, run_naive_fp64, NAMES, FP32_TOL, what="y")
assert_all_close = CHECKS.assert_all_close


# --------------------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------------------


@given(lengths=doc_lengths(max_total=320), groups=st.sampled_from([1, G]), D_shape=st.sampled_from(["heads", "hp"]))
def test_packed_equals_naive_recurrence_per_document(lengths, groups, D_shape):
    inputs = make_inputs(sum(lengths), seed=len(lengths), groups=groups, D_shape=D_shape)
    CHECKS.assert_equals_oracle(inputs, seq_idx_of(lengths))


def test_tolerance_catches_dropped_boundaries():
    """The control: the same comparison with the boundaries dropped (one long document) misses by far."""
    lengths = [50, 40, 60]
    inputs = make_inputs(sum(lengths), seed=3)
    CHECKS.assert_tolerance_catches_dropped_boundaries(inputs, seq_idx_of(lengths), seq_idx_of([sum(lengths)]))


@pytest.mark.parametrize("groups", [1, G])
@pytest.mark.parametrize("total, chunk_size", [(200, 64), (256, 64), (37, 16), (300, 256)])
def test_single_document_equals_stock_function(groups, total, chunk_size):
    inputs = make_inputs(total, seed=total, groups=groups)
    y, grads, dy = run_op(inputs, torch.zeros(1, total, dtype=torch.int32), chunk_size)
    assert y.dtype == torch.float32
    assert_all_close(y, grads, *run_stock(inputs, dy, chunk_size))


@pytest.mark.parametrize("chunk_size", [64, 256])
def test_packed_equals_stock_function_per_document(chunk_size):
    """Against transformers itself: the packed op equals the stock scan run on each document alone."""
    lengths = [100, 1, 64, 200, 17, 130]
    inputs = make_inputs(sum(lengths), seed=4)
    y, grads, dy = run_op(inputs, seq_idx_of(lengths), chunk_size)

    def per_document(x, dt, A, B, C, D, dt_bias):
        pieces = zip(*(t.split(lengths, dim=1) for t in (x, dt, B, C)))
        return torch.cat([STOCK_SCAN(x_, dt_, A, B_, C_, chunk_size, D=D, dt_bias=dt_bias, **SCAN_KW)
                          for x_, dt_, B_, C_ in pieces], dim=1)

    y_ref = per_document(*inputs)
    assert_all_close(y, grads, y_ref.detach(), torch.autograd.grad(y_ref, inputs, dy))


def test_stock_function_leaks_across_documents():
    """What the op fixes: the stock function on a packed row mixes the later documents with the earlier ones."""
    lengths = [50, 80, 30]
    inputs = make_inputs(sum(lengths))
    dy = torch.randn(1, sum(lengths), H, P)
    y_stock, _ = run_stock(inputs, dy)
    y_ref, _ = run_naive_fp64(inputs, seq_idx_of(lengths), dy)
    assert max_error(y_stock[:, :50], y_ref[:, :50]) < FP32_TOL  # the first document cannot leak
    assert max_error(y_stock[:, 50:], y_ref[:, 50:]) > 1e-2


@pytest.mark.parametrize("dt_softplus, dt_limit", [(False, (0.0, float("inf"))), (True, (0.2, 0.9))])
def test_dt_processing_matches_stock_function(dt_softplus, dt_limit):
    """No softplus, and a clamp that cuts both ends (its gradient is zero outside the limits)."""
    inputs = make_inputs(90, seed=5)
    with torch.no_grad():
        inputs[1].abs_()  # without softplus dt must already be positive
    kwargs = dict(dt_softplus=dt_softplus, dt_limit=dt_limit)
    y, grads, dy = run_op(inputs, torch.zeros(1, 90, dtype=torch.int32), 32, **kwargs)
    assert_all_close(y, grads, *run_stock(inputs, dy, 32, **kwargs))


def test_batch_rows_are_independent():
    """Two rows packed differently: each row equals its documents alone (the naive oracle runs row by row, and
    sums the per-head parameters' gradients over both)."""
    lengths_per_row = [[70, 1, 57], [3, 125]]
    inputs = make_inputs(128, batch=2, seed=6)
    CHECKS.assert_equals_oracle(inputs, torch.cat([seq_idx_of(lengths) for lengths in lengths_per_row]))


def test_zero_length_documents_change_nothing():
    """Skipped document indices (the collator's empty slots) are no documents: same results, bit for bit."""
    lengths = [30, 1, 69]
    CHECKS.assert_same_bits(make_inputs(sum(lengths)), seq_idx_of(lengths), seq_idx_of(lengths) * 3 + 2)


def test_optional_D_and_dt_bias_and_bfloat16_inputs():
    """bfloat16 inputs: the output is float32, as transformers' scan returns; the gradients keep their dtype."""
    x, dt, A, B, C = (t.detach() for t in make_inputs(40, dtype=torch.bfloat16, seed=7)[:5])
    seq_idx = seq_idx_of([10, 30])
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C)]
    y = mamba2_chunk_scan_varlen(*leaves, 16, seq_idx=seq_idx)
    stock = STOCK_SCAN(x[:, 10:], dt[:, 10:], A, B[:, 10:], C[:, 10:], 16)
    assert y.dtype == stock.dtype == torch.float32
    assert_close(y[:, 10:], stock, "y", 1e-3)  # bf16 dt clamp and products on both sides
    grads = torch.autograd.grad(y.sum(), leaves)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 5


@pytest.mark.parametrize(
    "bf16", [("x", "dt", "B", "C"), ("dt",), ("x", "B", "C")], ids=["all-bf16", "dt-bf16", "x-B-C-bf16"]
)
def test_autocast_bfloat16_forward_and_backward(bf16):
    """As a patched Bamba runs under ``torch.autocast("cpu", dtype=torch.bfloat16)``: x, B, C and dt come out of
    autocast matmuls in bf16 (or fp32, by path), A, D and dt_bias stay fp32; the backward runs after the autocast
    region, as training loops do. The op computes in fp32 inside (autocast is off in op bodies) and returns fp32.
    Failed before: the saved chunk states were bf16 and the backward's einsums mixed them with fp32."""
    lengths = [20, 50]
    inputs = make_inputs(sum(lengths), seed=8)
    inputs = [t.detach().to(torch.bfloat16).requires_grad_() if name in bf16 else t for name, t in zip(NAMES, inputs)]
    seq_idx = seq_idx_of(lengths)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = scan(inputs, seq_idx, 16)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(y, inputs, dy)
    assert y.dtype == torch.float32
    y_ref, grads_ref = run_naive_fp64(inputs, seq_idx, dy)
    assert_close(y, y_ref, "y", FP32_TOL)
    for name, got, ref in zip(NAMES, grads, grads_ref):
        assert got.dtype == (torch.bfloat16 if name in bf16 else torch.float32)
        assert_close(got, ref, f"d{name}", BF16_TOL if name in bf16 else FP32_TOL)


# --------------------------------------------------------------------------------------------------------------
# Exactness: fp64 gradcheck and bit-exact document isolation
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths, batch, D_shape",
    [([3, 1, 6], 1, "heads"), ([9], 1, "hp"), ([4, 1, 3], 1, "heads"), ([2, 5], 2, "hp")],
    ids=["several+1-token", "crosses-two-chunk-edges", "ends-on-chunk-edge", "two-rows"],
)
def test_fp64_gradcheck(lengths, batch, D_shape):
    """Chunks of 4 tokens, 2 heads on one B/C group: every input's gradient, through every mask."""
    inputs = make_inputs(sum(lengths), batch=batch, seed=11, groups=1, D_shape=D_shape, dims=(2, 2, 3))
    seq_idx = seq_idx_of(lengths).expand(batch, -1)
    assert gradcheck(lambda *t: scan(t, seq_idx, chunk_size=4), inputs)


@given(lengths=doc_lengths(max_total=200))
def test_documents_isolated_to_the_bit(lengths):
    """Another document's values change neither this document's output nor reach its gradients, in any bit."""
    lengths = at_least_two_documents(lengths)
    seq_idx = seq_idx_of(lengths)
    assert_packing_isolated(lambda t: scan(t, seq_idx), lambda seed: make_inputs(sum(lengths), seed=seed), lengths,
                            TOKEN_DIMS, 1)


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


def op_args(inputs, lengths, chunk_size=32, backend="reference", optional=True):
    x, dt, A, B, C, D, dt_bias = inputs
    if not optional:
        D = dt_bias = None
    return (x, dt, A, B, C, seq_idx_of(lengths), D, dt_bias, chunk_size, True, 0.0, float("inf"), backend)


def opcheck_mamba2(args):
    """opcheck of the forward and backward ops (the backward takes the forward's output); returns what is saved."""
    needs = [t is not None for t in args[:5] + args[6:8]]
    return contract.opcheck_forward_and_backward(mamba2.OP, args, needs, with_output=True)


@pytest.mark.parametrize("lengths, optional", [([1], False), ([30, 1, 33, 64, 64, 5], True)])
def test_opcheck(lengths, optional):
    opcheck_mamba2(op_args(make_inputs(sum(lengths), seed=2), lengths, optional=optional))


def loss_of(x, dt, A, B, C, D, dt_bias, seq_idx):
    return scan([x, dt, A, B, C, D, dt_bias], seq_idx, 32).square().sum()


def grads_of(x, dt, A, B, C, D, dt_bias, seq_idx):
    inputs = [x, dt, A, B, C, D, dt_bias]
    return torch.autograd.grad(loss_of(*inputs, seq_idx), inputs)


def test_explain_one_graph_no_breaks():
    contract.assert_one_graph(loss_of, grads_of, (*make_inputs(70), seq_idx_of([20, 50])))


def test_compiles_once_across_lengths_and_packings():
    # aot_eager, not a bare counter: fakes and saved-tensor shapes are traced, so a size-1 chunk count (a batch
    # of at most one chunk) would show up as a recompile
    packings = [[40], [10, 30, 3], [1] * 9, [100, 28], [64, 1, 64], [7, 70, 7, 7]]
    calls = ((*make_inputs(sum(lengths), seed=i), seq_idx_of(lengths)) for i, lengths in enumerate(packings))
    contract.assert_compiles_once(loss_of, calls)


def test_aot_eager_backward_matches_eager():
    lengths = [33, 1, 60]
    contract.assert_aot_eager_grads_equal_eager(loss_of, make_inputs(sum(lengths)), [seq_idx_of(lengths)], NAMES)


# --------------------------------------------------------------------------------------------------------------
# CUDA path on CPU: a fake mamba-ssm module that checks mamba-ssm's argument contract, answers with the reference
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_ssd(monkeypatch):
    fake = FakeSSD()
    loaded = route_kernels(monkeypatch, "mamba_ssm", {SSD_COMBINED: fake})
    yield fake
    assert loaded, "the mamba_ssm path never loaded mamba-ssm"


@pytest.mark.parametrize("optional", [True, False], ids=["D+dt_bias", "no-D-no-dt_bias"])
def test_mamba_ssm_path_contract_and_results(fake_ssd, optional):
    lengths = [20, 1, 43]
    inputs = make_inputs(sum(lengths), seed=9)
    if not optional:
        inputs = inputs[:5]
    seq_idx = seq_idx_of(lengths).long()  # the op must hand the library int32
    dy = torch.randn(1, sum(lengths), H, P)

    def run(backend):
        x, dt, A, B, C, *optional_inputs = inputs
        x = x.transpose(2, 3).contiguous().transpose(2, 3)  # non-contiguous: the glue must make it contiguous
        D, dt_bias = optional_inputs or (None, None)
        y = mamba2_chunk_scan_varlen(x, dt, A, B, C, 32, D=D, dt_bias=dt_bias, seq_idx=seq_idx, backend=backend,
                                     **SCAN_KW)
        return y.detach(), torch.autograd.grad(y, inputs, dy)

    y, grads = run("mamba_ssm")
    assert fake_ssd.calls == ["scan_forward", "scan_backward"]
    y_ref, grads_ref = run("reference")
    assert fake_ssd.calls == ["scan_forward", "scan_backward"]  # the reference never reaches the library
    assert_all_close(y, grads, y_ref, grads_ref, tol=1e-6)


def test_mamba_ssm_path_passes_opcheck(fake_ssd):
    """The kernel path's fake (output in x's dtype, nothing saved) matches what the glue returns."""
    lengths = [30, 1, 33]
    assert opcheck_mamba2(op_args(make_inputs(sum(lengths), batch=1, seed=10), lengths, backend="mamba_ssm")) == []


# --------------------------------------------------------------------------------------------------------------
# Errors checkable from shapes and dtypes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(x=lambda x: x[0]), r"x must be \[b, T, H, P\]"),
        (dict(dt=lambda t: t[..., :2]), r"dt must be \[b, T, H\] = \(1, 10, 4\), got \(1, 10, 2\)"),
        (dict(A=lambda t: t[:3]), r"A must be \[H\]"),
        (dict(B=lambda t: torch.ones(1, 10, 3, N)), r"B must be \[b, T, G, N\] .* H = 4 a multiple of G"),
        (dict(C=lambda t: t[..., :2]), r"C must be the shape of B"),
        (dict(D=lambda t: torch.ones(3)), r"D must be \[H\] = \(4,\) or \[H, P\]"),
        (dict(dt_bias=lambda t: torch.ones(2)), r"dt_bias must be \[H\]"),
        (dict(seq_idx=lambda t: t[:, :9]), r"seq_idx must be \[b, T\] = \(1, 10\), got \(1, 9\)"),
        (dict(seq_idx=lambda t: t.float()), r"seq_idx must be an int32 .* got torch.float32"),
        (dict(chunk_size=lambda c: 0), r"chunk_size must be a positive Python int"),
        (dict(chunk_size=lambda c: 8.0), r"chunk_size must be a positive Python int"),
        (dict(x=lambda x: x.long()), r"x must be a floating-point tensor"),
    ],
)
def test_shape_errors(change, message):
    x, dt, A, B, C, D, dt_bias = (t.detach() for t in make_inputs(10))
    args = dict(x=x, dt=dt, A=A, B=B, C=C, chunk_size=8, D=D, dt_bias=dt_bias, seq_idx=seq_idx_of([10]))
    args |= {name: edit(args[name]) for name, edit in change.items()}
    with pytest.raises(ValueError, match=f"mamba2_chunk_scan_varlen: {message}"):
        mamba2_chunk_scan_varlen(**args)


def test_seq_idx_is_a_required_keyword():
    x, dt, A, B, C = (t.detach() for t in make_inputs(10)[:5])
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'seq_idx'"):
        mamba2_chunk_scan_varlen(x, dt, A, B, C, 8)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'mamba'"):
        scan(make_inputs(10), seq_idx_of([10]), backend="mamba")


def test_every_family_shares_the_stock_scan():
    """Bamba, Mamba2, Zamba2, FalconH1, NemotronH and GraniteMoeHybrid carry the same mamba2_chunk_scan."""
    import importlib

    from compilepack.patching.builder import function_behind

    def source(name):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        pieces = [module.mamba2_chunk_scan, module.segment_sum, module.pad_tensor_by_size, module.reshape_into_chunks]
        return [inspect.getsource(inspect.unwrap(function_behind(f) or f)) for f in pieces]  # 5.25: kernels modules

    reference = source("bamba")
    for name in ("mamba2", "zamba2", "falcon_h1", "nemotron_h", "granitemoehybrid"):
        assert source(name) == reference, name
