"""compilepack::varlen_attention: packed == the naive per-document attention, equal to transformers' SDPA attention
on one document, exact fp64 gradients (gradcheck), documents isolated to the bit, one graph under torch.compile, and
the flash-attn and torch-varlen paths driven on CPU through fakes that check the argument contracts.

Tolerances: the op computes in fp32 (fp64 for fp64 inputs). Outputs and gradients are compared with an absolute
bound of 1e-5 scaled by the largest magnitude of the reference tensor (at least 1). Measured against the fp64 oracle
over 60 hypothesis packings with windows, causal and bidirectional: <= 1.6e-6 of the largest entry (a 530-token
document, over the CPU flash kernel's 512-key blocks: 4.4e-7); boundaries dropped: 1.2, 10^5 times the tolerance.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch._dynamo
from hypothesis import example, given
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sliding_window_causal_mask_function

from compilepack.ops import attention
from compilepack.ops.attention import NO_WINDOW, attention_naive, varlen_attention
from tests.ops import contract
from tests.ops.fakes import route_kernels
from tests.ops.fakes.flash_attn import FakeFlashAttn
from tests.ops.fakes.torch_varlen import RELEASES as TORCH_RELEASES
from tests.ops.fakes.torch_varlen import FakeTorchVarlen
from tests.ops.oracle import OpChecks, one_thread, output_and_grads, output_and_random_grads, run_fp64
from tests.ops.properties import assert_packing_isolated, at_least_two_documents, gradcheck, max_error
from tests.strategies import cu_seqlens_of, doc_lengths

H, HKV, D = 4, 2, 16  # grouped-query attention (two query heads per key/value head)
FP32_TOL = 1e-5
NAMES = "q k v".split()


def make_inputs(total: int, seed: int = 0, dtype=torch.float32, heads=(H, HKV), dims=(D, D)):
    gen = torch.Generator().manual_seed(seed)
    (h, hkv), (d, dv) = heads, dims
    q = torch.randn(total, h, d, generator=gen)
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, dv, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def run_op(inputs, cu_seqlens, grad_seed: int = 1, max_seqlen: int | None = None, **kwargs):
    max_seqlen = inputs[0].shape[0] if max_seqlen is None else max_seqlen  # the row length: always an upper bound
    return output_and_random_grads(varlen_attention(*inputs, cu_seqlens, max_seqlen, **kwargs), inputs, grad_seed)


def run_naive_fp64(inputs, cu_seqlens, grad, **kwargs):
    return run_fp64(lambda *x: attention_naive(*x, cu_seqlens, **kwargs), inputs, grad)


def run_stock(inputs, grad, causal=True, window=None, rows=1):
    """transformers' SDPA attention function on ``rows`` equal-length sequences (the layout a model hands it)."""
    q, k, v = (x.view(rows, -1, *x.shape[1:]).transpose(1, 2) for x in inputs)  # [B, heads, L, dim]
    layer = types.SimpleNamespace(is_causal=causal, num_key_value_groups=q.shape[1] // k.shape[1], training=True)
    mask = None
    if window is not None:
        position = torch.arange(q.shape[2])
        mask = sliding_window_causal_mask_function(window)(0, 0, position[:, None], position[None, :])[None, None]
    out = sdpa_attention_forward(layer, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0].flatten(0, 1)
    return output_and_grads(out, inputs, grad)


CHECKS = OpChecks(run_op, run_naive_fp64, NAMES, FP32_TOL)
assert_all_close = CHECKS.assert_all_close


def check_against_naive(lengths, seed=0, heads=(H, HKV), dims=(D, D), **kwargs):
    inputs = make_inputs(sum(lengths), seed=seed, heads=heads, dims=dims)
    cu = cu_seqlens_of(lengths)
    out, grads, grad = run_op(inputs, cu, max_seqlen=max(lengths), **kwargs)
    assert_all_close(out, grads, *run_naive_fp64(inputs, cu, grad, **kwargs))


# one_thread() for tests that make thousands of tiny kernel calls (hypothesis, gradcheck, isolation): each CPU flash
# call is a thread barrier, which costs milliseconds on shared cores (measured on 2 loaded cores: 64 five-token
# documents fwd+bwd 294 ms on 2 threads, 49 ms on 1). Results are bit-identical: the kernel computes each row on one
# thread.


# --------------------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------------------


@given(lengths=doc_lengths(max_total=320))
@example(lengths=[1] * 64)
@example(lengths=[31, 1, 33, 64])  # around the CPU flash kernel's 32-query blocks
@example(lengths=[3, 530])  # over its 512-key blocks: the online softmax rescales across blocks
def test_packed_equals_naive_attention_per_document(lengths):
    with one_thread():
        check_against_naive(lengths, seed=len(lengths))


@given(lengths=doc_lengths(max_total=200), window=st.integers(1, 20), causal=st.booleans())
def test_sliding_window_equals_naive_attention_per_document(lengths, window, causal):
    with one_thread():
        check_against_naive(lengths, seed=window, window=window, causal=causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (6, 3)])
def test_head_layouts_causal_and_bidirectional(heads, causal):
    check_against_naive([9, 1, 17], heads=heads, causal=causal)


@pytest.mark.parametrize("dims", [(16, 8), (8, 24)], ids=["narrow-values", "wide-values"])
def test_value_head_dim_may_differ_from_the_query_head_dim(dims):
    """MLA layers use narrower values than queries; the op pads to one head dim internally, exactly."""
    inputs = make_inputs(20, dims=dims)
    out = varlen_attention(*inputs, cu_seqlens_of([7, 1, 12]), 12)
    assert out.shape == (20, H, dims[1])
    check_against_naive([7, 1, 12], dims=dims)


def test_tolerance_catches_dropped_boundaries():
    """The control: the same comparison with the boundaries dropped (one long document) misses by far."""
    lengths = [30, 20, 40]
    inputs = make_inputs(sum(lengths), seed=3)
    CHECKS.assert_tolerance_catches_dropped_boundaries(inputs, cu_seqlens_of(lengths), cu_seqlens_of([sum(lengths)]))


@pytest.mark.parametrize(
    "causal, window, heads", [(True, None, (H, HKV)), (False, None, (3, 3)), (True, 5, (4, 1))],
    ids=["causal-gqa", "bidirectional", "sliding-window"],
)
def test_single_document_equals_stock_function(causal, window, heads):
    inputs = make_inputs(40, heads=heads)
    out, grads, grad = run_op(inputs, cu_seqlens_of([40]), causal=causal, window=window)
    assert_all_close(out, grads, *run_stock(inputs, grad, causal=causal, window=window))


def test_batch_rows_are_documents():
    """Flattened rows of a batch, one document each, equal transformers' attention on the batch."""
    inputs = make_inputs(3 * 25)
    out, grads, grad = run_op(inputs, cu_seqlens_of([25, 25, 25]))
    assert_all_close(out, grads, *run_stock(inputs, grad, rows=3))


def test_stock_attention_leaks_on_a_packed_row():
    """What the op fixes: one causal attention over the packed row (an unpatched model without a mask) mixes the
    second document with the first."""
    lengths = [20, 30]
    inputs = make_inputs(sum(lengths))
    grad = torch.randn(sum(lengths), H, D)
    out_stock, _ = run_stock(inputs, grad)
    out_ref, _ = run_naive_fp64(inputs, cu_seqlens_of(lengths), grad)
    assert max_error(out_stock[20:], out_ref[20:]) > 1e-2


def test_zero_length_documents_change_nothing():
    CHECKS.assert_same_bits(make_inputs(12), cu_seqlens_of([5, 7]), cu_seqlens_of([5, 0, 7, 0, 0]))


def test_max_seqlen_is_only_an_upper_bound():
    inputs = make_inputs(19)
    cu = cu_seqlens_of([5, 11, 3])
    assert torch.equal(varlen_attention(*inputs, cu, 11), varlen_attention(*inputs, cu, 19))


def test_reference_reads_the_host_copy_of_the_boundaries(monkeypatch):
    """With ``cu_seqlens_cpu`` given, the document loop reads it (never copying ``cu_seqlens`` off a device)."""
    read = []
    monkeypatch.setattr(attention.reference, "host_boundaries", lambda x: read.append(x.data_ptr()) or x.tolist())
    inputs = make_inputs(12)
    cu = cu_seqlens_of([5, 7])
    cu_cpu = cu.clone()
    out, grads, _ = run_op(inputs, cu, cu_seqlens_cpu=cu_cpu)
    assert read == [cu_cpu.data_ptr()] * 2  # forward and backward
    out_ref, grads_ref, _ = run_op(inputs, cu)
    assert read[2:] == [cu.data_ptr()] * 2
    assert_all_close(out, grads, out_ref, grads_ref, tol=0.0)


def test_bfloat16_inputs_keep_their_dtype():
    CHECKS.assert_bfloat16_kept(make_inputs(30, dtype=torch.bfloat16), cu_seqlens_of([10, 20]), (30, H, D))


def test_autocast_bfloat16_forward_and_backward():
    """Under CPU autocast the op computes in fp32 inside (autocast is off in custom-op bodies) and returns q's dtype."""
    CHECKS.assert_autocast_computes_in_fp32(make_inputs(30, seed=7), cu_seqlens_of([12, 18]), window=6)


# --------------------------------------------------------------------------------------------------------------
# Exactness: fp64 gradcheck and bit-exact document isolation
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths, kwargs, heads, dims",
    [
        ([3, 1, 5], {}, (2, 1), (3, 3)),
        ([4, 1, 5], {"window": 3}, (2, 1), (3, 3)),
        ([3, 1, 4], {"causal": False}, (2, 2), (3, 3)),
        ([4, 1, 5], {"causal": False, "window": 2}, (3, 1), (2, 2)),
        ([3, 1, 4], {}, (2, 1), (4, 3)),
        ([3, 1, 4], {}, (2, 1), (2, 3)),
    ],
    ids=["causal-gqa", "sliding-window", "bidirectional", "bidirectional-window-gqa", "mla-narrow-v", "mla-wide-v"],
)
def test_fp64_gradcheck(lengths, kwargs, heads, dims):
    """fp64 gradients are exact (before the op computed the log-sum-exp in fp32 only, and the fp64 backward failed)."""
    inputs = make_inputs(sum(lengths), seed=11, heads=heads, dims=dims)
    cu = cu_seqlens_of(lengths)
    with one_thread():
        assert gradcheck(lambda *x: varlen_attention(*x, cu, max(lengths), **kwargs), inputs)


@pytest.mark.parametrize("kwargs", [{}, {"window": 3}, {"causal": False}], ids=["causal", "window", "bidirectional"])
def test_explicit_math_path_off_cpu(monkeypatch, kwargs):
    """The reference's path off CPU (explicit masked scores, explicit backward), run here on CPU tensors: equal to the
    oracle in fp32, exact in fp64."""
    monkeypatch.setattr(attention.reference, "_document_forward", attention.reference._math_forward)
    monkeypatch.setattr(attention.reference, "_document_backward", attention.reference._math_backward)
    check_against_naive([9, 1, 17], **kwargs)
    lengths = [4, 1, 5]
    inputs = make_inputs(sum(lengths), seed=12, heads=(2, 1), dims=(3, 2))
    cu = cu_seqlens_of(lengths)
    with one_thread():
        assert gradcheck(lambda *x: varlen_attention(*x, cu, 5, **kwargs), inputs)


@given(lengths=doc_lengths(max_total=150), window=st.sampled_from([None, 4]))
def test_documents_isolated_to_the_bit(lengths, window):
    """Another document's values change neither this document's output nor reach its gradients, in any bit."""
    lengths = at_least_two_documents(lengths)
    cu = cu_seqlens_of(lengths)
    run = lambda x: varlen_attention(*x, cu, max(lengths), window=window)  # noqa: E731
    with one_thread():
        assert_packing_isolated(run, lambda seed: make_inputs(sum(lengths), seed=seed), lengths, [0] * 3, 0)


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


def op_args(inputs, lengths, backend="reference", window_left=NO_WINDOW, host_copy=False):
    cu = cu_seqlens_of(lengths)
    return (*inputs, cu, cu.clone() if host_copy else None, max(lengths), True, D**-0.5, window_left, backend)


def opcheck_attention(args):
    """opcheck of the forward and backward ops (the backward takes the forward's output); returns the saved lse."""
    return contract.opcheck_forward_and_backward(attention.OP, args, [True] * 3, with_output=True)


@pytest.mark.parametrize(
    "lengths, dtype, window_left, host_copy",
    [([1], torch.float32, NO_WINDOW, False), ([7, 1, 12], torch.float32, 3, True),
     ([3] * 10, torch.bfloat16, NO_WINDOW, False), ([7, 1, 12], torch.float64, 3, False)],
)
def test_opcheck(lengths, dtype, window_left, host_copy):
    inputs = make_inputs(sum(lengths), seed=2, dtype=dtype)
    (lse,) = opcheck_attention(op_args(inputs, lengths, window_left=window_left, host_copy=host_copy))
    assert lse.shape == (H, sum(lengths)) and lse.dtype == torch.promote_types(dtype, torch.float32)


def loss_of(q, k, v, cu_seqlens, max_seqlen):
    return varlen_attention(q, k, v, cu_seqlens, max_seqlen).square().sum()


def grads_of(q, k, v, cu_seqlens, max_seqlen):
    return torch.autograd.grad(loss_of(q, k, v, cu_seqlens, max_seqlen), [q, k, v])


def test_explain_one_graph_no_breaks():
    contract.assert_one_graph(loss_of, grads_of, (*make_inputs(14), cu_seqlens_of([5, 9]), 9))


def test_compiles_once_across_lengths_and_document_counts():
    # aot_eager, not a bare counter: fakes and saved-tensor shapes are traced, so a wrong fake fails here
    packings = [[5, 9], [3, 3, 3, 7], [40], [1, 2, 3, 4, 5, 6], [17, 0, 2], [8] * 9]
    calls = ((*make_inputs(sum(lengths), seed=i), cu_seqlens_of(lengths), max(lengths))
             for i, lengths in enumerate(packings))
    contract.assert_compiles_once(loss_of, calls, backward=True)


def test_aot_eager_backward_matches_eager():
    lengths = [12, 1, 30]
    contract.assert_aot_eager_grads_equal_eager(loss_of, make_inputs(sum(lengths)), [cu_seqlens_of(lengths), 30], NAMES)


# --------------------------------------------------------------------------------------------------------------
# CUDA paths on CPU: fakes of flash-attn and of torch's varlen ops that check the argument contracts
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_flash_attn(monkeypatch):
    fake = FakeFlashAttn()
    route_kernels(monkeypatch, "flash_attn", {"flash_attn.flash_attn_interface": fake})
    return fake


KERNEL_CASES = pytest.mark.parametrize(
    "kwargs", [{}, {"window": 4}, {"causal": False}, {"causal": False, "window": 3}],
    ids=["causal", "window", "bidirectional", "bidirectional-window"],
)


def check_kernel_path(backend, kwargs, fake):
    lengths = [6, 1, 11]
    inputs = make_inputs(sum(lengths), seed=4, dims=(D, 8))  # MLA-narrow values: padded before the kernel
    cu = cu_seqlens_of(lengths)
    out, grads, _ = run_op(inputs, cu, max_seqlen=11, backend=backend, **kwargs)
    assert fake.calls == ["forward", "backward"]
    out_ref, grads_ref, _ = run_op(inputs, cu, max_seqlen=11, **kwargs)
    assert_all_close(out, grads, out_ref, grads_ref)


@KERNEL_CASES
def test_flash_attn_path_contract_and_results(fake_flash_attn, kwargs):
    check_kernel_path("flash_attn", kwargs, fake_flash_attn)


@KERNEL_CASES
@pytest.mark.parametrize("release", list(TORCH_RELEASES))
def test_torch_varlen_path_contract_and_results(monkeypatch, kwargs, release):
    """Each torch release's varlen ops, with the schema its wheel declares (tests/ops/fakes/torch_varlen.py)."""
    check_kernel_path("torch_varlen", kwargs, FakeTorchVarlen.route(monkeypatch, release))


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_kernel_paths_keep_their_float32_lse_and_pass_opcheck(monkeypatch, backend):
    """The kernels' log-sum-exp is float32 whatever the inputs (the reference's follows the compute dtype)."""
    if backend == "flash_attn":
        route_kernels(monkeypatch, backend, {"flash_attn.flash_attn_interface": FakeFlashAttn()})
    else:
        FakeTorchVarlen.route(monkeypatch)
    lengths = [7, 1, 12]
    inputs = make_inputs(sum(lengths), seed=5, dtype=torch.float64)
    (lse,) = opcheck_attention(op_args(inputs, lengths, backend=backend, window_left=3))
    assert lse.dtype == torch.float32 and lse.shape == (H, sum(lengths))


# --------------------------------------------------------------------------------------------------------------
# Errors checkable from shapes and dtypes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"][0]), r"expects q, k, v as \[T, heads, head_dim\]; got q \(4, 16\)"),
        (lambda a: a.update(k=a["k"][:, :1].expand(-1, 3, -1)), r"query heads \(4\) must be a multiple of key/value "
         r"heads \(k 3, v 2\)"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"].float()), "cu_seqlens must be a 1-D int32 tensor, got "
         "torch.float32"),
        (lambda a: a.update(cu_seqlens_cpu=a["cu_seqlens"].to("meta")), r"cu_seqlens_cpu must be the host copy of "
         r"cu_seqlens \(1-D, on the CPU\), got \(3,\) on meta"),
    ],
)
def test_shape_errors_name_the_argument(change, message):
    q, k, v = (x.detach() for x in make_inputs(8))
    args = dict(q=q, k=k, v=v, cu_seqlens=cu_seqlens_of([3, 5]), max_seqlen=5)
    change(args)
    with pytest.raises(ValueError, match=message):
        varlen_attention(**args)


def test_boundaries_that_do_not_cover_the_tokens_are_refused():
    q, k, v = make_inputs(8)
    with pytest.raises(ValueError, match="must start at 0 and end at the token count 8; got 0 ... 6"):
        varlen_attention(q, k, v, torch.tensor([0, 4, 6], dtype=torch.int32), 4)


def test_the_document_loop_refuses_decreasing_boundaries_itself():
    # what a CUDA reference call without the host copy relies on (the op's up-front check reads host tensors only)
    message = "^varlen_attention: cu_seqlens must not decrease, but goes from 6 to 4 at index 2; "
    with pytest.raises(ValueError, match=message):
        attention.reference._documents(torch.tensor([0, 6, 4, 8], dtype=torch.int32), None, 8)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'flash'"):
        varlen_attention(*make_inputs(8), cu_seqlens_of([8]), 8, backend="flash")
