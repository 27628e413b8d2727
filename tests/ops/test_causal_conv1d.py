"""compilepack::causal_conv1d_varlen: packed == one F.conv1d per document (the naive oracle), equal to transformers on
one document, exact fp64 gradients (gradcheck), documents isolated to the bit (outputs, dx, and dweight/dbias),
channel-last layouts, one graph under torch.compile, and the causal-conv1d path driven on CPU through a fake
causal-conv1d module that checks the argument contract.

Both reference routes are tested: shift and mask (what runs off the CPU and for small CPU inputs) and the CPU route
for large inputs (a blind depthwise conv2d, then the boundary rows recomputed), forced with ``on_route``.

Tolerances: the op computes in fp32 (as the CUDA kernel). Outputs and gradients are compared with an absolute bound of
1e-5 scaled by the largest magnitude of the reference tensor (at least 1): out and dx sum W products, dweight and
dbias sum over every token of the row (up to 640 here) in another order than the oracle (measured against the fp64
oracle over 24 packings, both routes, W = 2..4, with and without silu: out 1.7e-7, dx 5.1e-7, dweight 9.2e-7,
dbias 4.8e-7 of the largest entry; boundaries dropped: out 0.49, gradients >= 0.10).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn as stock_causal_conv1d_fn

from compilepack.ops import causal_conv1d as conv
from compilepack.ops.causal_conv1d import causal_conv1d_naive, causal_conv1d_varlen, reference
from tests.ops import contract
from tests.ops.fakes import route_kernels
from tests.ops.fakes.causal_conv1d import MODULES, FakeCausalConv1d
from tests.ops.oracle import one_thread, output_and_random_grads
from tests.ops.properties import assert_close, assert_documents_isolated, at_least_two_documents, gradcheck, max_error
from tests.strategies import bounds_of, doc_lengths, seq_idx_of

FP32_TOL = 1e-5
DIM = 8  # a multiple of 8, so the kernel-path tests can use the same shapes
NAMES = ["x", "weight", "bias"]
ROUTES = ["shift_and_mask", "conv2d_fix_rows"]


def on_route(route: str):
    """Force one reference route whatever the size: shift and mask, or the blind conv2d with recomputed rows."""
    threshold = {"shift_and_mask": 1 << 62, "conv2d_fix_rows": 0}[route]
    return mock.patch.object(reference, "CONV2D_MIN_ELEMENTS", threshold)


def make_inputs(lengths, dim=DIM, width=4, batch=1, dtype=torch.float32, seed=0, bias=True):
    """[x, weight, bias]: x channel-last [B, D, T] as transformers passes it, weight [D, W], bias [D] or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, sum(lengths), dim, generator=gen).transpose(1, 2)
    weight = torch.randn(dim, width, generator=gen)
    b = torch.randn(dim, generator=gen) if bias else None
    return [t if t is None else t.to(dtype).requires_grad_() for t in (x, weight, b)]


def present(inputs):
    return [t for t in inputs if t is not None]


def run_op(inputs, seq_idx, activation="silu", grad_seed=1, **kwargs):
    out = causal_conv1d_varlen(*inputs, seq_idx, activation, **kwargs)
    return output_and_random_grads(out, present(inputs), grad_seed)


def run_naive_fp64(inputs, seq_idx, activation, grad_out):
    inputs64 = [t if t is None else t.detach().double().requires_grad_() for t in inputs]
    # one thread: the fp64 oracle is many tiny convs (torch's fp64 grouped conv runs one per channel)
    with one_thread():
        out = causal_conv1d_naive(*inputs64, seq_idx, activation)
        return out.detach(), list(torch.autograd.grad(out, present(inputs64), grad_out.double()))


def run_stock(inputs, activation, grad_out):
    out = stock_causal_conv1d_fn(*inputs, activation=activation)
    return out.detach(), list(torch.autograd.grad(out, present(inputs), grad_out))


def assert_all_close(out, grads, out_ref, grads_ref, tol=FP32_TOL):
    assert out.shape == out_ref.shape
    assert_close(out, out_ref, "output", tol)
    for name, got, ref in zip(NAMES, grads, grads_ref):
        assert_close(got, ref, f"d{name}", tol)


# --------------------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------------------


@given(
    lengths=doc_lengths(max_total=320),
    width=st.sampled_from([2, 3, 4]),
    activation=st.sampled_from([None, "silu"]),
    route=st.sampled_from(ROUTES),
)
def test_packed_equals_naive_per_document(lengths, width, activation, route):
    inputs = make_inputs(lengths, dim=4, width=width, seed=len(lengths))  # D = 4: the oracle's cost is per channel
    seq_idx = seq_idx_of(lengths)
    with on_route(route):
        out, grads, grad_out = run_op(inputs, seq_idx, activation)
    assert_all_close(out, grads, *run_naive_fp64(inputs, seq_idx, activation, grad_out))


def test_tolerance_catches_dropped_boundaries():
    """The control: the same comparison with the boundaries dropped (one long document) misses by far."""
    lengths = [50, 40, 60]
    inputs = make_inputs(lengths, seed=3)
    out, grads, grad_out = run_op(inputs, seq_idx_of([sum(lengths)]))
    out_ref, grads_ref = run_naive_fp64(inputs, seq_idx_of(lengths), "silu", grad_out)
    assert max_error(out, out_ref) > 100 * FP32_TOL
    assert min(max_error(got, ref) for got, ref in zip(grads, grads_ref)) > 100 * FP32_TOL


@pytest.mark.parametrize("activation", [None, "silu"])
def test_single_document_equals_stock_function(activation):
    inputs = make_inputs([37], batch=2, dim=16)
    seq_idx = torch.tensor([[4] * 37, [5] * 37], dtype=torch.int32)
    out, grads, grad_out = run_op(inputs, seq_idx, activation)
    assert_all_close(out, grads, *run_stock(inputs, activation, grad_out))


def test_stock_function_leaks_across_documents():
    """What the op fixes: the stock function on a packed row mixes each document's first tokens with the previous."""
    lengths = [6, 5, 7]
    inputs = make_inputs(lengths)
    grad_out = torch.randn(1, DIM, sum(lengths))
    out_stock, _ = run_stock(inputs, "silu", grad_out)
    out_ref, _ = run_naive_fp64(inputs, seq_idx_of(lengths), "silu", grad_out)
    assert max_error(out_stock[..., :6], out_ref[..., :6]) < FP32_TOL
    assert max_error(out_stock[..., 6:], out_ref[..., 6:]) > 1e-2


@pytest.mark.parametrize("route", ROUTES)
def test_batch_rows_are_independent_with_global_ids(route):
    """B > 1: every row starts a document, even when its first id continues the previous row's last id."""
    seq_idx = torch.tensor([[0] * 3 + [1] * 5 + [2], [2] * 2 + [3] * 7], dtype=torch.int32)  # id 2 spans both rows
    inputs = make_inputs([9], batch=2, width=3)
    with on_route(route):
        out, grads, grad_out = run_op(inputs, seq_idx)
    assert_all_close(out, grads, *run_naive_fp64(inputs, seq_idx, "silu", grad_out))


def test_zero_length_documents_change_nothing():
    """Ids that skip values (documents of no tokens) give exactly what consecutive ids give."""
    inputs = make_inputs([30, 70], batch=2)
    consecutive = torch.tensor([[0] * 30 + [1] * 70, [2] * 60 + [3] * 40], dtype=torch.int32)
    skipping = torch.tensor([[1] * 30 + [4] * 70, [4] * 60 + [9] * 40], dtype=torch.int32)
    out, grads, _ = run_op(inputs, consecutive)
    out_skip, grads_skip, _ = run_op(inputs, skipping)
    assert torch.equal(out, out_skip)
    assert all(torch.equal(got, ref) for got, ref in zip(grads_skip, grads))


@pytest.mark.parametrize("activation", [None, "silu"])
def test_routes_agree_at_model_size(activation):
    """At a real layer size the CPU default is the conv2d route; shift and mask agrees with it (fp32, B = 2)."""
    lengths = [100, 1, 3, 200, 40]
    inputs = make_inputs(lengths, batch=2, dim=1024)
    seq_idx = seq_idx_of(lengths).expand(2, -1)
    assert inputs[0].numel() >= reference.CONV2D_MIN_ELEMENTS
    out, grads, grad_out = run_op(inputs, seq_idx, activation)
    with on_route("shift_and_mask"):
        out_masked, grads_masked, _ = run_op(inputs, seq_idx, activation)
    assert_all_close(out, grads, out_masked, grads_masked)


def test_without_bias():
    lengths = [5, 1, 7]
    inputs = make_inputs(lengths, bias=False)
    out, grads, grad_out = run_op(inputs, seq_idx_of(lengths))
    assert len(grads) == 2
    assert_all_close(out, grads, *run_naive_fp64(inputs, seq_idx_of(lengths), "silu", grad_out))


def test_frozen_conv_weights_x_grad_only():
    """A frozen conv (weight and bias without grad): the backward skips their gradients, dx stays exact."""
    lengths = [6, 1, 2, 9]
    x, weight, bias = make_inputs(lengths)
    inputs = [x, weight.detach(), bias.detach()]
    out = causal_conv1d_varlen(*inputs, seq_idx_of(lengths), "silu")
    grad_out = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, grad_out)
    _, (dx_ref, *_) = run_naive_fp64([x, weight, bias], seq_idx_of(lengths), "silu", grad_out)
    assert_close(dx, dx_ref, "dx", FP32_TOL)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", ["channel_last", "contiguous", "sliced"])
def test_output_channel_last_and_dx_laid_out_like_x(route, layout):
    lengths = [4, 6]
    x_cl, weight, bias = make_inputs(lengths, batch=2)
    x = {
        "channel_last": x_cl,
        "contiguous": x_cl.detach().contiguous().requires_grad_(),
        "sliced": torch.randn(2, 10, 3 * DIM).transpose(1, 2)[:, DIM : 2 * DIM].requires_grad_(),
    }[layout]
    seq_idx = seq_idx_of(lengths).expand(2, -1)
    with on_route(route):
        out, (dx, *_), grad_out = run_op([x, weight, bias], seq_idx)
    assert out.stride() == (10 * DIM, 1, DIM)
    assert dx.stride() == torch.empty_like(x).stride()
    _, (dx_ref, *_) = run_naive_fp64([x, weight, bias], seq_idx, "silu", grad_out)
    assert_close(dx, dx_ref, "dx", FP32_TOL)


@pytest.mark.parametrize("route", ROUTES)
def test_channel_last_dx_needs_no_copy(route):
    """For the channel-last fp32 x transformers passes, the path's dx already has ``empty_like(x)``'s layout and
    dtype, so the scaffold hands it on as is (no extra [B, D, T] copy on the common path)."""
    lengths = [4, 6]
    x, weight, bias = (t.detach() for t in make_inputs(lengths, batch=2))
    grad_out = torch.randn(2, sum(lengths), DIM).transpose(1, 2)
    seq_idx = seq_idx_of(lengths).expand(2, -1)
    with on_route(route):
        dx, _, _ = reference.backward(grad_out, None, [], [True, True, True], x, weight, bias, seq_idx, True)
    like = torch.empty_like(x)
    assert (dx.stride(), dx.dtype) == (like.stride(), like.dtype)


def test_bfloat16_inputs_keep_their_dtype():
    lengths = [5, 9]
    inputs = make_inputs(lengths, dtype=torch.bfloat16)
    out, grads, grad_out = run_op(inputs, seq_idx_of(lengths))
    assert out.dtype == torch.bfloat16 and out.stride() == (14 * DIM, 1, DIM)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    out_ref, _ = run_naive_fp64(inputs, seq_idx_of(lengths), "silu", grad_out)
    assert_close(out, out_ref, "output", 1e-2)  # one bf16 rounding of the fp32 result


def test_autocast_bfloat16_forward_and_backward():
    """Under CPU autocast the op computes in fp32 inside (autocast is off in custom-op bodies) and returns x's dtype."""
    lengths = [20, 1, 30]
    inputs = make_inputs(lengths, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads, grad_out = run_op(inputs, seq_idx_of(lengths))
    assert out.dtype == torch.float32
    assert_all_close(out, grads, *run_naive_fp64(inputs, seq_idx_of(lengths), "silu", grad_out))


# --------------------------------------------------------------------------------------------------------------
# Exactness: fp64 gradcheck and bit-exact document isolation
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route, lengths, width, batch, activation, bias",
    [
        ("shift_and_mask", [3, 1, 5], 3, 1, "silu", True),
        ("shift_and_mask", [1, 1, 4, 2], 4, 1, None, False),
        ("shift_and_mask", [2, 5], 2, 2, "silu", True),
        ("conv2d_fix_rows", [2, 1, 3], 3, 1, "silu", True),
    ],
    ids=["several+1-token", "shorter-than-W", "two-rows", "conv2d-route"],
)
def test_fp64_gradcheck(route, lengths, width, batch, activation, bias):
    inputs = make_inputs(lengths, dim=2, width=width, batch=batch, seed=11, bias=bias)
    seq_idx = seq_idx_of(lengths).expand(batch, -1)
    with_bias = lambda x, weight, bias: causal_conv1d_varlen(x, weight, bias, seq_idx, activation)  # noqa: E731
    without_bias = lambda x, weight: causal_conv1d_varlen(x, weight, None, seq_idx, activation)  # noqa: E731
    with on_route(route):
        assert gradcheck(with_bias if bias else without_bias, present(inputs))


def isolation_case(lengths):
    """At least two documents, and three of them to check (first, middle, last)."""
    lengths = at_least_two_documents(lengths)
    return lengths, {0, len(lengths) // 2, len(lengths) - 1}


@given(lengths=doc_lengths(), width=st.sampled_from([2, 4]), route=st.sampled_from(ROUTES))
def test_documents_isolated_to_the_bit(lengths, width, route):
    """Another document's values change neither this document's output nor reach its dx, in any bit."""
    lengths, documents = isolation_case(lengths)
    seq_idx, bounds = seq_idx_of(lengths), bounds_of(lengths)
    run = lambda t: causal_conv1d_varlen(*t, seq_idx, "silu")  # noqa: E731
    inputs, others = make_inputs(lengths, width=width, seed=1), make_inputs(lengths, width=width, seed=2)
    with on_route(route):
        for document in documents:
            assert_documents_isolated(run, inputs, others, [2, None, None], 2, bounds, document)


def grads_of_one_document(inputs, seq_idx, bounds, document):
    """dx on the document's own tokens, dweight and dbias, from a loss on that document's output alone."""
    start, end = bounds[document], bounds[document + 1]
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = causal_conv1d_varlen(*leaves, seq_idx, "silu")[..., start:end]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(document))
    dx, dweight, dbias = torch.autograd.grad((out * weights).sum(), leaves)
    return dx[..., start:end], dweight, dbias


@given(lengths=doc_lengths(), width=st.sampled_from([2, 4]), route=st.sampled_from(ROUTES))
def test_weight_grads_isolated_to_the_bit(lengths, width, route):
    """dweight and dbias from a loss on one document do not change, in any bit, when other documents' x changes:
    the pairs that cross a start are zero factors inside the sums, never subtracted from a sum that held them."""
    lengths, documents = isolation_case(lengths)
    seq_idx, bounds = seq_idx_of(lengths), bounds_of(lengths)
    inputs = make_inputs(lengths, width=width, seed=1)
    x_other = make_inputs(lengths, width=width, seed=2)[0].detach()
    with on_route(route):
        for document in documents:
            start, end = bounds[document], bounds[document + 1]
            mixed_x = x_other.clone()
            mixed_x[..., start:end] = inputs[0][..., start:end]
            grads = grads_of_one_document(inputs, seq_idx, bounds, document)
            grads_mixed = grads_of_one_document([mixed_x, *inputs[1:]], seq_idx, bounds, document)
            for name, got, ref in zip(NAMES, grads_mixed, grads):
                assert torch.equal(got, ref), f"document {document}: d{name} depends on other documents"


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route, lengths",
    [("shift_and_mask", [1]), ("shift_and_mask", [2, 1, 5]), ("shift_and_mask", [9, 1, 1, 3]),
     ("conv2d_fix_rows", [2, 1, 5])],
)
@pytest.mark.parametrize("with_bias, silu", [(True, True), (False, False)])
def test_opcheck(route, lengths, with_bias, silu):
    args = (*make_inputs(lengths, batch=2, bias=with_bias), seq_idx_of(lengths).expand(2, -1).contiguous(), silu,
            "reference")
    needs_grad = [True, True, with_bias] if silu else [True, False, False]  # without silu: dx alone (a frozen conv)
    with on_route(route):
        contract.opcheck_forward_and_backward(conv.OP, args, needs_grad)


def loss_of(x, weight, bias, seq_idx):
    return causal_conv1d_varlen(x, weight, bias, seq_idx, "silu").square().sum()


def grads_of(x, weight, bias, seq_idx):
    return torch.autograd.grad(loss_of(x, weight, bias, seq_idx), (x, weight, bias))


def test_explain_one_graph_no_breaks():
    lengths = [3, 1, 6]
    contract.assert_one_graph(loss_of, grads_of, (*make_inputs(lengths), seq_idx_of(lengths)))


def test_compiles_once_across_lengths_and_document_counts():
    # aot_eager, not a bare counter: the fakes of the forward and backward ops are traced too
    # first T (9) differs from D (8) and W (4): duck sizing would otherwise share one symbol and recompile
    packings = [[5, 4], [1, 1, 1, 9, 2], [17], [2] * 11, [30, 1, 4], [6, 6, 6, 6, 6, 6, 7]]
    calls = ((*make_inputs(lengths, seed=i), seq_idx_of(lengths)) for i, lengths in enumerate(packings))
    contract.assert_compiles_once(loss_of, calls, backward=True, equals_eager=True)


def test_aot_eager_backward_matches_eager():
    lengths = [7, 1, 2, 12]
    inputs = make_inputs(lengths)
    seq_idx = seq_idx_of(lengths)
    compiled = torch.compile(grads_of, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        grads = compiled(*inputs, seq_idx)
    for name, got, ref in zip(NAMES, grads, grads_of(*inputs, seq_idx)):
        assert got.stride() == ref.stride() and torch.equal(got, ref), f"d{name}"


# --------------------------------------------------------------------------------------------------------------
# CUDA path on CPU: a fake causal-conv1d that checks the argument contract and returns reference results
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_kernel(monkeypatch):
    fake = FakeCausalConv1d()
    route_kernels(monkeypatch, "causal_conv1d", dict.fromkeys(MODULES, fake))
    return fake


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("layout", ["channel_last", "contiguous"])
def test_kernel_path_contract_and_results(fake_kernel, with_bias, layout):
    lengths = [5, 1, 2, 8]
    x, weight, bias = make_inputs(lengths, batch=2, dim=16, bias=with_bias)
    if layout == "contiguous":
        x = x.detach().contiguous().requires_grad_()
    seq_idx = seq_idx_of(lengths).expand(2, -1)  # an expanded (non-contiguous) int32 view: the glue must fix it
    out, grads, grad_out = run_op([x, weight, bias], seq_idx, backend="causal_conv1d")
    assert fake_kernel.calls == ["fwd", "bwd"]
    assert out.stride() == (16 * 16, 1, 16) and grads[0].stride() == torch.empty_like(x).stride()
    assert [g.dtype for g in grads] == [torch.float32] * len(grads)
    out_ref, grads_ref, _ = run_op([x, weight, bias], seq_idx)
    assert_all_close(out, grads, out_ref, grads_ref, tol=0.0)


def test_kernel_path_opcheck(fake_kernel):
    lengths = [4, 1, 3]
    inputs = make_inputs(lengths, batch=2, dim=16)
    args = (*inputs, seq_idx_of(lengths).expand(2, -1).contiguous(), True, "causal_conv1d")
    torch.library.opcheck(conv.OP.forward, args)  # the fake's layout is what the library allocates
    out, saved = conv.OP.forward(*args)
    plain = [t.detach() for t in inputs]
    torch.library.opcheck(conv.OP.backward, (torch.randn_like(out), None, saved, [True] * 3, *plain, *args[3:]))
    assert set(fake_kernel.calls) == {"fwd", "bwd"}


@pytest.mark.parametrize(
    "dim, width, dtype", [(6, 4, torch.float32), (8, 5, torch.float32), (8, 4, torch.float64)],
    ids=["D%8", "W>4", "float64"],
)
def test_kernel_path_falls_back_for_unsupported_inputs(fake_kernel, dim, width, dtype):
    lengths = [3, 4]
    inputs = make_inputs(lengths, dim=dim, width=width, dtype=dtype)
    out, grads, grad_out = run_op(inputs, seq_idx_of(lengths), backend="causal_conv1d")
    assert fake_kernel.calls == []
    assert_all_close(out, grads, *run_naive_fp64(inputs, seq_idx_of(lengths), "silu", grad_out))


def test_kernel_path_compiles_with_aot_eager(fake_kernel):
    lengths = [4, 1, 11]
    inputs = make_inputs(lengths)

    def fn(x, weight, bias, seq_idx):
        return causal_conv1d_varlen(x, weight, bias, seq_idx, "silu", backend="causal_conv1d")

    out = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")(*inputs, seq_idx_of(lengths))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    assert fake_kernel.calls == ["fwd", "bwd"]
    assert_all_close(out.detach(), grads, *run_naive_fp64(inputs, seq_idx_of(lengths), "silu", grad_out))


# --------------------------------------------------------------------------------------------------------------
# Errors checkable from shapes and dtypes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(x=a["x"][0]), "x must be a float [B, D, T] tensor, got 2-D"),
        (lambda a: a.update(x=a["x"].long()), "x must be a float [B, D, T] tensor, got 3-D torch.int64"),
        (lambda a: a.update(weight=a["weight"][:, None]), "weight must be a float [D, W] tensor with D=8"),
        (lambda a: a.update(weight=a["weight"][:4]), "weight must be a float [D, W] tensor with D=8 (x.shape[1])"),
        (lambda a: a.update(bias=a["bias"][:3]), "bias must be None or a float [D] tensor with D=8"),
        (lambda a: a.update(seq_idx=a["seq_idx"][:, :-1]), "seq_idx must have shape [B, T] = (1, 8)"),
        (lambda a: a.update(seq_idx=a["seq_idx"][0]), "seq_idx must have shape [B, T] = (1, 8)"),
        (lambda a: a.update(seq_idx=a["seq_idx"].float()), "seq_idx must be an integer tensor"),
        (lambda a: a.update(activation="gelu"), "activation must be one of (None, 'silu', 'swish'), got 'gelu'"),
    ],
)
def test_argument_errors(change, message):
    lengths = [3, 5]
    x, weight, bias = (t.detach() for t in make_inputs(lengths))
    args = dict(x=x, weight=weight, bias=bias, seq_idx=seq_idx_of(lengths), activation="silu")
    change(args)
    with pytest.raises(ValueError) as info:
        causal_conv1d_varlen(**args)
    assert message in str(info.value)


def test_unknown_backend_is_refused():
    lengths = [3, 5]
    with pytest.raises(ValueError, match="unknown backend 'causal_conv'"):
        causal_conv1d_varlen(*make_inputs(lengths), seq_idx_of(lengths), backend="causal_conv")


def test_swish_is_silu():
    lengths = [3, 5]
    inputs = make_inputs(lengths)
    out_swish = causal_conv1d_varlen(*inputs, seq_idx_of(lengths), "swish")
    assert torch.equal(out_swish, causal_conv1d_varlen(*inputs, seq_idx_of(lengths), "silu"))
