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
from tests.ops import contract, delta_rule
from tests.ops.fakes.fla import FakeFla
from tests.ops.oracle import OpChecks, output_and_grads, output_and_random_grads, run_fp64
from tests.ops.properties import assert_packing_isolated, at_least_two_documents, gradcheck, max_error
from tests.strategies import cu_seqlens_of, doc_lengths

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
    return output_and_random_grads(o, inputs, grad_seed)


def run_naive_fp64(inputs, cu_seqlens, do, use_qk_l2norm=True, **kwargs):
    return run_fp64(lambda *x: kimi_delta_attention_naive(*x, cu_seqlens, use_qk_l2norm, **kwargs), inputs, do)


def run_stock(inputs, do=None):
    q, k, v, g, beta = inputs
    o = STOCK(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    return (o.detach(), None) if do is None else output_and_grads(o, inputs, do)


CHECKS = OpChecks(run_op, run_naive_fp64, NAMES, FP32_TOL)
assert_all_close = CHECKS.assert_all_close
KDA = delta_rule.DeltaRule(kimi_delta_attention_varlen, kda.OP, make_inputs, CHECKS, FLA_MODULE)


# --------------------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------------------


@given(lengths=doc_lengths(max_total=320))
def test_packed_equals_naive_recurrence_per_document(lengths):
    CHECKS.assert_equals_oracle(make_inputs(sum(lengths), seed=len(lengths)), cu_seqlens_of(lengths))


def test_tolerance_catches_dropped_boundaries():
    """The control: the same comparison with the boundaries dropped (one long document) misses by far."""
    lengths = [50, 40, 60]
    inputs = make_inputs(sum(lengths), seed=3)
    CHECKS.assert_tolerance_catches_dropped_boundaries(inputs, cu_seqlens_of(lengths), cu_seqlens_of([sum(lengths)]))


def test_without_l2norm_and_custom_scale():
    delta_rule.assert_without_l2norm_and_custom_scale(KDA)


def test_fast_decays_stay_exact():
    """Decays of ~-60 per token: exp(+-sum of g) over a chunk overflows fp32, so a factorisation of the pair decay
    into exp(G_i) exp(-G_j) would give inf/nan; sub-chunk pairs elementwise and bounded factors stay exact."""
    inputs = make_inputs(80, seed=7, decay=60.0)
    chunk_decay = inputs[3].detach()[0, : kda.reference.CHUNK].sum(0)
    assert (chunk_decay < -100).float().mean() > 0.9  # exp(100) > fp32 max: a factorised product would overflow
    CHECKS.assert_equals_oracle(inputs, cu_seqlens_of([25, 55]))


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
    CHECKS.assert_same_bits(make_inputs(100), cu_seqlens_of([30, 70]), cu_seqlens_of([0, 30, 0, 70, 0, 0]))


def test_bfloat16_inputs_keep_their_dtype():
    CHECKS.assert_bfloat16_kept(make_inputs(40, dtype=torch.bfloat16), cu_seqlens_of([15, 25]), (1, 40, HV, V))


def test_autocast_bfloat16_forward_and_backward():
    """Under CPU autocast the op computes in fp32 inside (autocast is off in custom-op bodies) and returns q's dtype."""
    CHECKS.assert_autocast_computes_in_fp32(make_inputs(70, seed=7), cu_seqlens_of([20, 50]))


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
    lengths = at_least_two_documents(lengths)
    cu = cu_seqlens_of(lengths)
    run = lambda x: kimi_delta_attention_varlen(*x, cu, True)  # noqa: E731
    assert_packing_isolated(run, lambda seed: make_inputs(sum(lengths), seed=seed), lengths, [1] * 5, 1)


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[32], [1, 7, 8, 2, 20], [10, 0, 30]])
def test_opcheck(lengths):
    args = (*make_inputs(sum(lengths), seed=2), cu_seqlens_of(lengths), None, True, K**-0.5, "reference")
    contract.opcheck_forward_and_backward(kda.OP, args, [True] * 5)


def loss_of(q, k, v, g, beta, cu_seqlens):
    return kimi_delta_attention_varlen(q, k, v, g, beta, cu_seqlens, True).square().sum()


def grads_of(q, k, v, g, beta, cu_seqlens):
    return torch.autograd.grad(loss_of(q, k, v, g, beta, cu_seqlens), [q, k, v, g, beta])


def test_explain_one_graph_no_breaks():
    contract.assert_one_graph(loss_of, grads_of, (*make_inputs(100), cu_seqlens_of([30, 70])))


def test_compiles_once_across_lengths_and_document_counts():
    # aot_eager, not a bare counter: fakes and saved-tensor shapes are traced, so a size-1 chunk count (a batch
    # of at most one chunk) would show up as a recompile
    packings = [[30, 70], [5, 5, 90, 3], [200], [1] * 7, [8, 8, 1], [17, 0, 40, 9, 9]]
    calls = ((*make_inputs(sum(lengths), seed=i), cu_seqlens_of(lengths)) for i, lengths in enumerate(packings))
    contract.assert_compiles_once(loss_of, calls, backward=True)


def test_aot_eager_backward_matches_eager():
    lengths = [30, 1, 80]
    contract.assert_aot_eager_grads_equal_eager(loss_of, make_inputs(sum(lengths)), [cu_seqlens_of(lengths)], NAMES)


# --------------------------------------------------------------------------------------------------------------
# CUDA path on CPU: a fake fla module that checks fla's argument contract and returns reference results
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_fla_path_contract_and_results(fake_fla, use_qk_l2norm):
    delta_rule.assert_fla_path_equals_reference(KDA, fake_fla, use_qk_l2norm)


def test_fla_path_flattens_batch_rows_and_passes_opcheck(fake_fla):
    shapes = [(2, 40, H, K), (2, 40, H), (2, 40, H, K), (2, 40, H), (2, 40, HV, K), (2, 40, HV, 64), (2, 40, HV, 64)]
    assert delta_rule.fla_saved_shapes(KDA, fake_fla, batch=2, length=40) == shapes


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
        *delta_rule.SHAPE_ERRORS,
        (lambda a: a.update(v=a["v"][:, :, :3], g=a["g"][:, :, :3], beta=a["beta"][..., :3]), "multiple of q's H"),
        (lambda a: a.update(g=a["g"][..., 0]), "g must be [B, T, HV, K]"),
        (lambda a: a.update(g=a["g"][..., :-1]), "g must be [B, T, HV, K]"),
    ],
)
def test_shape_errors(change, message):
    delta_rule.assert_shape_error(KDA, change, message)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'flaa'"):
        kimi_delta_attention_varlen(*make_inputs(10), cu_seqlens_of([10]), backend="flaa")
