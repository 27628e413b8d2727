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
from tests.ops import contract, delta_rule
from tests.ops.oracle import OpChecks, output_and_grads, output_and_random_grads, run_fp64
from tests.ops.properties import assert_packing_isolated, at_least_two_documents, gradcheck, max_error
from tests.strategies import cu_seqlens_of, doc_lengths

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
    return output_and_random_grads(gated_delta_rule_varlen(*inputs, cu_seqlens, **kwargs), inputs, grad_seed)


def run_naive_fp64(inputs, cu_seqlens, do, **kwargs):
    return run_fp64(lambda *x: gated_delta_rule_naive(*x, cu_seqlens, **kwargs), inputs, do)


def run_stock(inputs, do):
    q, k, v, g, beta = inputs
    o = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    return output_and_grads(o, inputs, do)


CHECKS = OpChecks(run_op, run_naive_fp64, NAMES, FP32_TOL)
assert_all_close = CHECKS.assert_all_close
GDR = delta_rule.DeltaRule(gated_delta_rule_varlen, gdr.OP, make_inputs, CHECKS, "fla.ops.gated_delta_rule.chunk")


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
    CHECKS.assert_same_bits(make_inputs(100), cu_seqlens_of([30, 70]), cu_seqlens_of([0, 30, 0, 70, 0, 0]))


def test_stock_function_leaks_across_documents():
    """What the op fixes: the stock function on a packed row mixes the second document with the first."""
    lengths = [50, 90]
    inputs = make_inputs(sum(lengths))
    do = torch.randn(1, sum(lengths), HV, V)
    o_stock, _ = run_stock(inputs, do)
    o_ref, _ = run_naive_fp64(inputs, cu_seqlens_of(lengths), do)
    assert max_error(o_stock[:, 50:], o_ref[:, 50:]) > 1e-2


def test_without_l2norm_and_custom_scale():
    delta_rule.assert_without_l2norm_and_custom_scale(GDR)


def test_bfloat16_inputs_keep_their_dtype():
    CHECKS.assert_bfloat16_kept(make_inputs(80, dtype=torch.bfloat16), cu_seqlens_of([20, 60]), (1, 80, HV, V))


def test_autocast_bfloat16_forward_and_backward():
    """Under CPU autocast the op computes in fp32 inside (autocast is off in custom-op bodies) and returns q's dtype."""
    CHECKS.assert_autocast_computes_in_fp32(make_inputs(70, seed=7), cu_seqlens_of([20, 50]))


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
    lengths = at_least_two_documents(lengths)
    cu = cu_seqlens_of(lengths)
    run = lambda x: gated_delta_rule_varlen(*x, cu)  # noqa: E731
    assert_packing_isolated(run, lambda seed: make_inputs(sum(lengths), seed=seed), lengths, [1] * 5, 1)


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[64], [1, 63, 64, 2], [10, 0, 30]])
def test_opcheck(lengths):
    args = (*make_inputs(sum(lengths), seed=2), cu_seqlens_of(lengths), None, True, K**-0.5, "reference")
    contract.opcheck_forward_and_backward(gdr.OP, args, [True] * 5)


def loss_of(q, k, v, g, beta, cu_seqlens):
    return gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens).square().sum()


def grads_of(q, k, v, g, beta, cu_seqlens):
    return torch.autograd.grad(loss_of(q, k, v, g, beta, cu_seqlens), [q, k, v, g, beta])


def test_explain_one_graph_no_breaks():
    contract.assert_one_graph(loss_of, grads_of, (*make_inputs(100), cu_seqlens_of([30, 70])))


def test_compiles_once_across_lengths_and_document_counts():
    # aot_eager, not a bare counter: fakes and saved-tensor shapes are traced, so a size-1 chunk count (a batch
    # of at most one chunk) would show up as a recompile
    packings = [[30, 70], [5, 5, 90, 3], [200], [1] * 7, [64, 64, 1], [17, 0, 40, 9, 9]]
    calls = ((*make_inputs(sum(lengths), seed=i), cu_seqlens_of(lengths)) for i, lengths in enumerate(packings))
    contract.assert_compiles_once(loss_of, calls)


def test_aot_eager_backward_matches_eager():
    lengths = [30, 1, 80]
    contract.assert_aot_eager_grads_equal_eager(loss_of, make_inputs(sum(lengths)), [cu_seqlens_of(lengths)], NAMES)


# --------------------------------------------------------------------------------------------------------------
# CUDA path on CPU: a fake fla module that checks fla's argument contract and returns reference results
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_fla_path_contract_and_results(fake_fla, use_qk_l2norm):
    delta_rule.assert_fla_path_equals_reference(GDR, fake_fla, use_qk_l2norm)


def test_fla_path_flattens_batch_rows_and_passes_opcheck(fake_fla):
    shapes = [(2, 70, H, K), (2, 70, H), (2, 70, H, K), (2, 70, H), (2, 70, HV), (2, 70, HV, 64)]
    assert delta_rule.fla_saved_shapes(GDR, fake_fla, batch=2, length=70) == shapes


# --------------------------------------------------------------------------------------------------------------
# Errors checkable from shapes and dtypes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        *delta_rule.SHAPE_ERRORS,
        (lambda a: a.update(v=a["v"][:, :, :3], g=a["g"][..., :3], beta=a["beta"][..., :3]), "multiple of q's H"),
        (lambda a: a.update(g=a["g"][..., None]), "g must be [B, T, HV]"),
    ],
)
def test_shape_errors(change, message):
    delta_rule.assert_shape_error(GDR, change, message)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'flaa'"):
        gated_delta_rule_varlen(*make_inputs(10), cu_seqlens_of([10]), backend="flaa")
