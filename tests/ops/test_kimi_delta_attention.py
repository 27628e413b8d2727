"""compilepack::kimi_delta_attention_varlen: packed == the naive per-document recurrence, equal to transformers on
one document, exact fp64 gradients (gradcheck), documents isolated to the bit, one graph under torch.compile, and
the fla path driven on CPU through a fake fla module that checks the argument contract.

Tolerances: the op computes in fp32 (as transformers does). Outputs and gradients are compared with an absolute
bound of 1e-5 scaled by the largest magnitude of the reference tensor (at least 1): the chunked algorithm sums
O(K * chunk) fp32 products per entry, so the error grows with the entry size, not with the token count
(measured against the fp64 oracle over the hypothesis packings: <= 9e-7 of the largest entry, outputs and every
gradient, dbeta the largest; with the boundaries dropped the output misses by 1.4e-1, 14000x the tolerance).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from transformers.models.kimi_linear import modeling_kimi_linear

from compilepack.ops import kimi_delta_attention as kda
from compilepack.ops.kimi_delta_attention import kimi_delta_attention_naive, kimi_delta_attention_varlen
from tests.compiling import graphs_compiled
from tests.ops.fakes import route_kernels
from tests.ops.fakes.fla import FakeFla
from tests.ops.properties import assert_close, assert_documents_isolated, gradcheck, max_error
from tests.strategies import bounds_of, cu_seqlens_of, doc_lengths

STOCK = inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)  # the torch fallback (no kernel lookup)
H, HV, K, V = 2, 4, 16, 8  # grouped value heads (HV = 2 H), fla's layout; Kimi Linear itself has HV == H
FP32_TOL = 1e-5
NAMES = "q k v g beta".split()
FLA_MODULE = "fla.ops.kda.chunk"


def make_inputs(total: int, batch: int = 1, seed: int = 0, dtype=torch.float32, heads=(H, HV), dims=(K, V), decay=1.0):
    gen = torch.Generator().manual_seed(seed)
    (h, hv), (dk, dv) = heads, dims
    q = torch.randn(batch, total, h, dk, generator=gen)
    k = torch.randn(batch, total, h, dk, generator=gen)
    v = torch.randn(batch, total, hv, dv, generator=gen)
    # per-channel log decay <= 0, as Kimi's forget gate makes it (-exp(A_log) * softplus(...))
    g = -F.softplus(torch.randn(batch, total, hv, dk, generator=gen) - 1) * decay
    beta = torch.rand(batch, total, hv, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def run_op(inputs, cu_seqlens, grad_seed: int = 1, use_qk_l2norm=True, **kwargs):
    o = kimi_delta_attention_varlen(*inputs, cu_seqlens, use_qk_l2norm, **kwargs)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=o.dtype)
    return o.detach(), list(torch.autograd.grad(o, inputs, do)), do


def run_naive_fp64(inputs, cu_seqlens, do, use_qk_l2norm=True, **kwargs):
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    o = kimi_delta_attention_naive(*inputs64, cu_seqlens, use_qk_l2norm, **kwargs)
    return o.detach(), list(torch.autograd.grad(o, inputs64, do.double()))


def run_stock(inputs, do=None):
    q, k, v, g, beta = inputs
    o = STOCK(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    return o.detach(), (None if do is None else list(torch.autograd.grad(o, inputs, do)))


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


def test_without_l2norm_and_custom_scale():
    lengths = [40, 30]
    inputs = make_inputs(sum(lengths), seed=5)
    q, k = (F.normalize(x.detach(), dim=-1).requires_grad_() for x in inputs[:2])
    plain = [q, k, *inputs[2:]]
    cu = cu_seqlens_of(lengths)
    for scale in (0.3, None):
        o, grads, do = run_op(plain, cu, use_qk_l2norm=False, scale=scale)
        assert_all_close(o, grads, *run_naive_fp64(plain, cu, do, use_qk_l2norm=False, scale=scale))


def test_fast_decays_stay_exact():
    """Decays of ~-60 per token: exp(+-sum of g) over a chunk overflows fp32, so a factorisation of the pair decay
    into exp(G_i) exp(-G_j) would give inf/nan; sub-chunk pairs elementwise and bounded factors stay exact."""
    inputs = make_inputs(80, seed=7, decay=60.0)
    chunk_decay = inputs[3].detach()[0, : kda.reference.CHUNK].sum(0)
    assert (chunk_decay < -100).float().mean() > 0.9  # exp(100) > fp32 max: a factorised product would overflow
    cu = cu_seqlens_of([25, 55])
    o, grads, do = run_op(inputs, cu)
    assert_all_close(o, grads, *run_naive_fp64(inputs, cu, do))


def test_single_document_equals_stock_function():
    inputs = make_inputs(80, heads=(2, 2))  # transformers' fallback has no grouped values; 80 > its 64 chunk
    o, grads, do = run_op(inputs, cu_seqlens_of([80]))
    assert_all_close(o, grads, *run_stock(inputs, do))


def test_stock_function_leaks_across_documents():
    """What the op fixes: the stock function on a packed row mixes the second document with the first."""
    lengths = [50, 30]
    inputs = [x.detach() for x in make_inputs(sum(lengths), heads=(2, 2))]
    with torch.no_grad():
        o_stock, _ = run_stock(inputs)
    o_ref, _ = run_naive_fp64(inputs, cu_seqlens_of(lengths), torch.zeros(o_stock.shape))
    assert max_error(o_stock[:, 50:], o_ref[:, 50:]) > 1e-2


def test_batch_rows_are_documents():
    """B > 1: each row edge is a document edge, so B rows equal one packed row of B documents, bit for bit."""
    inputs = make_inputs(30, batch=3)
    o, grads, do = run_op(inputs, cu_seqlens_of([30, 30, 30]))
    flat = [x.detach().reshape(1, 90, *x.shape[2:]).requires_grad_() for x in inputs]
    o_ref, grads_ref, _ = run_op(flat, cu_seqlens_of([30, 30, 30]))
    assert torch.equal(o.reshape(o_ref.shape), o_ref)
    for name, got, ref in zip(NAMES, grads, grads_ref):
        assert torch.equal(got.reshape(ref.shape), ref), f"d{name}"


def test_zero_length_documents_change_nothing():
    inputs = make_inputs(100)
    o, grads, _ = run_op(inputs, cu_seqlens_of([30, 70]))
    o_pad, grads_pad, _ = run_op(inputs, torch.tensor([0, 0, 30, 30, 100, 100, 100], dtype=torch.int32))
    assert torch.equal(o, o_pad)
    for got, ref in zip(grads_pad, grads):
        assert torch.equal(got, ref)


def test_bfloat16_inputs_keep_their_dtype():
    inputs = make_inputs(40, dtype=torch.bfloat16)
    o, grads, _ = run_op(inputs, cu_seqlens_of([15, 25]))
    assert o.dtype == torch.bfloat16 and o.shape == (1, 40, HV, V)
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


# tiny dims: gradcheck runs the op twice per input element; sub-chunks are 4 tokens, chunks 32
@pytest.mark.parametrize("lengths", [[6, 1, 7], [29, 1, 4]], ids=["several+1-token", "crosses-chunk-edge"])
def test_fp64_gradcheck(lengths):
    inputs = make_inputs(sum(lengths), seed=11, heads=(1, 1), dims=(2, 2))
    cu = cu_seqlens_of(lengths)
    assert gradcheck(lambda *x: kimi_delta_attention_varlen(*x, cu, True), inputs)


def test_fp64_gradcheck_without_l2norm_two_rows_grouped_values():
    inputs = make_inputs(12, batch=2, seed=12, heads=(1, 2), dims=(2, 2))
    cu = cu_seqlens_of([5, 7, 12])
    assert gradcheck(lambda *x: kimi_delta_attention_varlen(*x, cu, False, 0.5), inputs)


@given(lengths=doc_lengths(max_total=160))
def test_documents_isolated_to_the_bit(lengths):
    """Another document's values change neither this document's output nor reach its gradients, in any bit."""
    if len(lengths) < 2:
        lengths = [*lengths, 7]
    total, bounds = sum(lengths), bounds_of(lengths)
    cu = cu_seqlens_of(lengths)
    run = lambda x: kimi_delta_attention_varlen(*x, cu, True)  # noqa: E731
    for document in {0, len(lengths) // 2, len(lengths) - 1}:
        assert_documents_isolated(
            run, make_inputs(total, seed=1), make_inputs(total, seed=2), [1] * 5, 1, bounds, document
        )


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[32], [1, 7, 8, 2, 20], [10, 0, 30]])
def test_opcheck(lengths):
    inputs = make_inputs(sum(lengths), seed=2)
    args = (*inputs, cu_seqlens_of(lengths), None, True, K**-0.5, "reference")
    torch.library.opcheck(kda.OP.forward, args)
    o, saved = kda.OP.forward(*args)
    # the backward op has no double backward: check it on plain tensors
    plain = [x.detach() for x in inputs]
    backward_args = (torch.randn_like(o), None, saved, [True] * 5, *plain, *args[5:])
    torch.library.opcheck(kda.OP.backward, backward_args)


def loss_of(q, k, v, g, beta, cu_seqlens):
    return kimi_delta_attention_varlen(q, k, v, g, beta, cu_seqlens, True).square().sum()


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
    packings = [[30, 70], [5, 5, 90, 3], [200], [1] * 7, [8, 8, 1], [17, 0, 40, 9, 9]]
    with graphs_compiled() as compiles:
        for i, lengths in enumerate(packings):
            compiled(*make_inputs(sum(lengths), seed=i), cu_seqlens_of(lengths)).backward()
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
    fake_fla[FLA_MODULE] = fake = FakeFla(sum(lengths))
    o, grads, do = run_op(inputs, cu, use_qk_l2norm=use_qk_l2norm, backend="fla", cu_seqlens_cpu=cu.clone())
    forward = ["l2norm_fwd"] * 2 * use_qk_l2norm + ["prepare_chunk_indices", "fwd"]
    assert fake.calls == forward + ["prepare_chunk_indices", "bwd"] + ["l2norm_bwd"] * 2 * use_qk_l2norm
    assert all(torch.equal(host, cu) for host in fake.host_boundaries), "fla must get the host copy of cu_seqlens"
    o_ref, grads_ref, _ = run_op(inputs, cu, use_qk_l2norm=use_qk_l2norm, backend="reference")
    assert_all_close(o, grads, o_ref, grads_ref)


def test_fla_path_flattens_batch_rows_and_passes_opcheck(fake_fla):
    inputs = make_inputs(40, batch=2, seed=6)
    cu = cu_seqlens_of([40, 40])
    fake_fla[FLA_MODULE] = FakeFla(80)
    args = (*inputs, cu, cu.clone(), True, K**-0.5, "fla")
    torch.library.opcheck(kda.OP.forward, args)  # the fake's saved shapes match fla's
    o, saved = kda.OP.forward(*args)
    shapes = [(2, 40, H, K), (2, 40, H), (2, 40, H, K), (2, 40, H), (2, 40, HV, K), (2, 40, HV, 64), (2, 40, HV, 64)]
    assert [tuple(s.shape) for s in saved] == shapes
    plain = [x.detach() for x in inputs]
    torch.library.opcheck(kda.OP.backward, (torch.randn_like(o), None, saved, [True] * 5, *plain, *args[5:]))


def test_fla_path_runs_the_reference_for_key_heads_over_256(fake_fla):
    """fla's chunk_kda asserts K <= 256: larger key heads run the reference, also on CUDA."""
    inputs = make_inputs(12, seed=8, dims=(320, 8))
    cu = cu_seqlens_of([5, 7])
    fake_fla[FLA_MODULE] = fake = FakeFla(12)
    o, grads, _ = run_op(inputs, cu, backend="fla")
    o_ref, grads_ref, _ = run_op(inputs, cu)
    assert fake.calls == []
    assert torch.equal(o, o_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))


# --------------------------------------------------------------------------------------------------------------
# Errors checkable from shapes and dtypes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be 4-D"),
        (lambda a: a.update(k=a["k"][..., :-1]), "k must have q's shape"),
        (lambda a: a.update(v=a["v"][:, :-1]), "v must be [B, T, HV, V]"),
        (lambda a: a.update(v=a["v"][:, :, :3], g=a["g"][:, :, :3], beta=a["beta"][..., :3]), "multiple of q's H"),
        (lambda a: a.update(g=a["g"][..., 0]), "g must be [B, T, HV, K]"),
        (lambda a: a.update(g=a["g"][..., :-1]), "g must be [B, T, HV, K]"),
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
        kimi_delta_attention_varlen(**args)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'flaa'"):
        kimi_delta_attention_varlen(*make_inputs(10), cu_seqlens_of([10]), backend="flaa")
