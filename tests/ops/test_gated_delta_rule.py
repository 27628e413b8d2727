"""compilepack::gated_delta_rule_varlen: packed == the naive per-document recurrence, equal to transformers on one
document, exact fp64 gradients (gradcheck), documents isolated to the bit, one graph under torch.compile, and the
fla path driven on CPU through a fake fla module that checks the argument contract.

Tolerances: the op computes in fp32 (as transformers does). Outputs and gradients are compared with an absolute
bound of 1e-5 scaled by the largest magnitude of the reference tensor (at least 1): the chunked algorithm sums
O(K * chunk) fp32 products per entry, so the error grows with the entry size, not with the token count
(measured against the fp64 oracle: <= 5e-7 of the largest entry; boundaries dropped: > 1e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from hypothesis import given
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from compilepack.ops import gated_delta_rule as gdr
from compilepack.ops.gated_delta_rule import gated_delta_rule_naive, gated_delta_rule_varlen
from tests.compiling import graphs_compiled
from tests.ops.fakes import route_kernels
from tests.ops.fakes.fla import FakeFla
from tests.ops.properties import assert_close, assert_documents_isolated, gradcheck, max_error
from tests.strategies import bounds_of, cu_seqlens_of, doc_lengths

H, HV, K, V = 2, 4, 16, 8  # grouped value heads (HV = 2 H) so the repeat_interleave mapping is exercised
FP32_TOL = 1e-5
NAMES = "q k v g beta".split()


def make_inputs(total: int, batch: int = 1, seed: int = 0, dtype=torch.float32, heads=(H, HV), dims=(K, V)):
    gen = torch.Generator().manual_seed(seed)
    (h, hv), (dk, dv) = heads, dims
    q = torch.randn(batch, total, h, dk, generator=gen)
    k = torch.randn(batch, total, h, dk, generator=gen)
    v = torch.randn(batch, total, hv, dv, generator=gen)
    g = F.logsigmoid(torch.randn(batch, total, hv, generator=gen) + 2)  # log decay <= 0, as Qwen3-Next makes it
    beta = torch.rand(batch, total, hv, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def run_op(inputs, cu_seqlens, grad_seed: int = 1, **kwargs):
    o = gated_delta_rule_varlen(*inputs, cu_seqlens, **kwargs)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=o.dtype)
    return o.detach(), list(torch.autograd.grad(o, inputs, do)), do


def run_naive_fp64(inputs, cu_seqlens, do, **kwargs):
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    o = gated_delta_rule_naive(*inputs64, cu_seqlens, **kwargs)
    return o.detach(), list(torch.autograd.grad(o, inputs64, do.double()))


def run_stock(inputs, do):
    q, k, v, g, beta = inputs
    o = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    return o.detach(), list(torch.autograd.grad(o, inputs, do))


def assert_all_close(o, grads, o_ref, grads_ref, tol=FP32_TOL):
    assert_close(o, o_ref, "output", tol)
    for name, got, ref in zip(NAMES, grads, grads_ref):
        assert_close(got, ref, f"d{name}", tol)


# --------------------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------------------


@given(lengths=doc_lengths(max_total=320))
def test_packed_equals_naive_recurrence_per_document(lengths):
    inputs = make_inputs(sum(lengths), seed=len(lengths))
    cu = cu_seqlens_of(lengths)
    o, grads, do = run_op(inputs, cu)
    assert_all_close(o, grads, *run_naive_fp64(inputs, cu, do))


def test_tolerance_catches_dropped_boundaries():
    """The control: the same comparison with the boundaries dropped (one long document) misses by far."""
    lengths = [50, 40, 60]
    inputs = make_inputs(sum(lengths), seed=3)
    o, _, do = run_op(inputs, cu_seqlens_of([sum(lengths)]))
    o_ref, _ = run_naive_fp64(inputs, cu_seqlens_of(lengths), do)
    assert max_error(o, o_ref) > 100 * FP32_TOL


@pytest.mark.parametrize("heads, dims", [((H, HV), (K, V)), ((3, 3), (8, 16)), ((1, 4), (16, 16))])
def test_single_document_equals_stock_function(heads, dims):
    inputs = make_inputs(150, heads=heads, dims=dims)
    o, grads, do = run_op(inputs, cu_seqlens_of([150]))
    assert_all_close(o, grads, *run_stock(inputs, do))


def test_batch_rows_are_documents():
    """B > 1: each row edge is a document edge, so B rows equal the stock function's batch of B sequences."""
    inputs = make_inputs(70, batch=3)
    o, grads, do = run_op(inputs, cu_seqlens_of([70, 70, 70]))
    assert_all_close(o, grads, *run_stock(inputs, do))


def test_zero_length_documents_change_nothing():
    inputs = make_inputs(100)
    o, grads, _ = run_op(inputs, cu_seqlens_of([30, 70]))
    o_pad, grads_pad, _ = run_op(inputs, torch.tensor([0, 0, 30, 30, 100, 100, 100], dtype=torch.int32))
    assert torch.equal(o, o_pad)
    for got, ref in zip(grads_pad, grads):
        assert torch.equal(got, ref)


def test_stock_function_leaks_across_documents():
    """What the op fixes: the stock function on a packed row mixes the second document with the first."""
    lengths = [50, 90]
    inputs = make_inputs(sum(lengths))
    do = torch.randn(1, sum(lengths), HV, V)
    o_stock, _ = run_stock(inputs, do)
    o_ref, _ = run_naive_fp64(inputs, cu_seqlens_of(lengths), do)
    assert max_error(o_stock[:, 50:], o_ref[:, 50:]) > 1e-2


def test_without_l2norm_and_custom_scale():
    lengths = [40, 30]
    inputs = make_inputs(sum(lengths), seed=5)
    q, k = (F.normalize(x.detach(), dim=-1).requires_grad_() for x in inputs[:2])
    plain = [q, k, *inputs[2:]]
    cu = cu_seqlens_of(lengths)
    for scale in (0.3, None):
        o, grads, do = run_op(plain, cu, use_qk_l2norm=False, scale=scale)
        assert_all_close(o, grads, *run_naive_fp64(plain, cu, do, use_qk_l2norm=False, scale=scale))


def test_bfloat16_inputs_keep_their_dtype():
    inputs = make_inputs(80, dtype=torch.bfloat16)
    o, grads, _ = run_op(inputs, cu_seqlens_of([20, 60]))
    assert o.dtype == torch.bfloat16 and o.shape == (1, 80, HV, V)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 5


def test_autocast_bfloat16_forward_and_backward():
    """Under CPU autocast the op computes in fp32 inside (autocast is off in custom-op bodies) and returns q's dtype."""
    inputs = make_inputs(70, seed=7)
    cu = cu_seqlens_of([20, 50])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, grads, do = run_op(inputs, cu)
    assert o.dtype == torch.float32
    assert_all_close(o, grads, *run_naive_fp64(inputs, cu, do))


# --------------------------------------------------------------------------------------------------------------
# Exactness: fp64 gradcheck and bit-exact document isolation
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths", [[9, 1, 14], [40], [31, 2, 1]], ids=["several+1-token", "crosses-chunk-edge", "chunk-edge-1"]
)
def test_fp64_gradcheck(lengths):
    inputs = make_inputs(sum(lengths), seed=11, dims=(4, 3))
    cu = cu_seqlens_of(lengths)
    assert gradcheck(lambda *x: gated_delta_rule_varlen(*x, cu), inputs)


def test_fp64_gradcheck_without_l2norm_two_rows():
    inputs = make_inputs(12, batch=2, seed=12, heads=(1, 2), dims=(4, 3))
    cu = cu_seqlens_of([5, 7, 12])
    assert gradcheck(lambda *x: gated_delta_rule_varlen(*x, cu, use_qk_l2norm=False, scale=0.5), inputs)


@given(lengths=doc_lengths(max_total=200))
def test_documents_isolated_to_the_bit(lengths):
    """Another document's values change neither this document's output nor reach its gradients, in any bit."""
    if len(lengths) < 2:
        lengths = [*lengths, 7]
    total, bounds = sum(lengths), bounds_of(lengths)
    cu = cu_seqlens_of(lengths)
    run = lambda x: gated_delta_rule_varlen(*x, cu)  # noqa: E731
    for document in {0, len(lengths) // 2, len(lengths) - 1}:
        assert_documents_isolated(
            run, make_inputs(total, seed=1), make_inputs(total, seed=2), [1] * 5, 1, bounds, document
        )


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[64], [1, 63, 64, 2], [10, 0, 30]])
def test_opcheck(lengths):
    inputs = make_inputs(sum(lengths), seed=2)
    args = (*inputs, cu_seqlens_of(lengths), None, True, K**-0.5, "reference")
    torch.library.opcheck(gdr.OP.forward, args)
    o, saved = gdr.OP.forward(*args)
    # the backward op has no double backward: check it on plain tensors
    plain = [x.detach() for x in inputs]
    backward_args = (torch.randn_like(o), None, saved, [True] * 5, *plain, *args[5:])
    torch.library.opcheck(gdr.OP.backward, backward_args)


def loss_of(q, k, v, g, beta, cu_seqlens):
    return gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens).square().sum()


def grads_of(q, k, v, g, beta, cu_seqlens):
    return torch.autograd.grad(loss_of(q, k, v, g, beta, cu_seqlens), [q, k, v, g, beta])


def test_explain_one_graph_no_breaks():
    args = (*make_inputs(100), cu_seqlens_of([30, 70]))
    forward = torch._dynamo.explain(loss_of)(*args)
    assert (forward.graph_count, forward.graph_break_count) == (1, 0), forward.break_reasons
    # autograd.grad inside the traced function needs this flag (off by default: it is a graph break otherwise)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        both = torch._dynamo.explain(grads_of)(*args)
    assert (both.graph_count, both.graph_break_count) == (1, 0), both.break_reasons


def test_compiles_once_across_lengths_and_document_counts():
    # aot_eager, not a bare counter: fakes and saved-tensor shapes are traced, so a size-1 chunk count (a batch
    # of at most one chunk) would show up as a recompile
    compiled = torch.compile(loss_of, fullgraph=True, dynamic=True, backend="aot_eager")
    packings = [[30, 70], [5, 5, 90, 3], [200], [1] * 7, [64, 64, 1], [17, 0, 40, 9, 9]]
    with graphs_compiled() as compiles:
        for i, lengths in enumerate(packings):
            compiled(*make_inputs(sum(lengths), seed=i), cu_seqlens_of(lengths))
        assert compiles() == 1


def test_aot_eager_backward_matches_eager():
    lengths = [30, 1, 80]
    inputs = make_inputs(sum(lengths))
    cu = cu_seqlens_of(lengths)
    compiled = torch.compile(loss_of, fullgraph=True, dynamic=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(*inputs, cu), inputs)
    grads_eager = torch.autograd.grad(loss_of(*inputs, cu), inputs)
    for name, got, ref in zip(NAMES, grads, grads_eager):
        assert_close(got, ref, f"d{name}", tol=1e-6)


# --------------------------------------------------------------------------------------------------------------
# CUDA path on CPU: a fake fla module that checks fla's argument contract and returns reference results
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_fla(monkeypatch):
    fakes = {}
    route_kernels(monkeypatch, "fla", fakes)
    return fakes


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_fla_path_contract_and_results(fake_fla, use_qk_l2norm):
    lengths = [40, 1, 70]
    inputs = make_inputs(sum(lengths), batch=1, seed=4)
    cu = cu_seqlens_of(lengths)
    fake_fla["fla.ops.gated_delta_rule.chunk"] = fake = FakeFla(sum(lengths))
    o, grads, do = run_op(inputs, cu, use_qk_l2norm=use_qk_l2norm, backend="fla", cu_seqlens_cpu=cu.clone())
    forward = ["l2norm_fwd"] * 2 * use_qk_l2norm + ["prepare_chunk_indices", "fwd"]
    assert fake.calls == forward + ["prepare_chunk_indices", "bwd"] + ["l2norm_bwd"] * 2 * use_qk_l2norm
    assert all(torch.equal(host, cu) for host in fake.host_boundaries), "fla must get the host copy of cu_seqlens"
    o_ref, grads_ref, _ = run_op(inputs, cu, use_qk_l2norm=use_qk_l2norm, backend="reference")
    assert_all_close(o, grads, o_ref, grads_ref)


def test_fla_path_flattens_batch_rows_and_passes_opcheck(fake_fla):
    inputs = make_inputs(70, batch=2, seed=6)
    cu = cu_seqlens_of([70, 70])
    fake_fla["fla.ops.gated_delta_rule.chunk"] = FakeFla(140)
    args = (*inputs, cu, cu.clone(), True, K**-0.5, "fla")
    torch.library.opcheck(gdr.OP.forward, args)  # the fake's saved shapes match fla's
    o, saved = gdr.OP.forward(*args)
    shapes = [(2, 70, H, K), (2, 70, H), (2, 70, H, K), (2, 70, H), (2, 70, HV), (2, 70, HV, 64)]
    assert [tuple(s.shape) for s in saved] == shapes
    plain = [x.detach() for x in inputs]
    torch.library.opcheck(gdr.OP.backward, (torch.randn_like(o), None, saved, [True] * 5, *plain, *args[5:]))


# --------------------------------------------------------------------------------------------------------------
# Errors checkable from shapes and dtypes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be 4-D"),
        (lambda a: a.update(k=a["k"][..., :-1]), "k must have q's shape"),
        (lambda a: a.update(v=a["v"][:, :-1]), "v must be [B, T, HV, V]"),
        (lambda a: a.update(v=a["v"][:, :, :3], g=a["g"][..., :3], beta=a["beta"][..., :3]), "multiple of q's H"),
        (lambda a: a.update(g=a["g"][..., None]), "g must be [B, T, HV]"),
        (lambda a: a.update(beta=a["beta"][:, :-1]), "beta must be [B, T, HV]"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"].float()), "cu_seqlens must be a 1-D int32"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"][None]), "cu_seqlens must be a 1-D int32"),
        (lambda a: a.update(q=a["q"].long(), k=a["k"].long()), "q must be a float tensor"),
    ],
)
def test_shape_errors(change, message):
    q, k, v, g, beta = (x.detach() for x in make_inputs(20))
    args = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens_of([20]))
    change(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        gated_delta_rule_varlen(**args)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'flaa'"):
        gated_delta_rule_varlen(*make_inputs(10), cu_seqlens_of([10]), backend="flaa")
