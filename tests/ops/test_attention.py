"""compilepack::varlen_attention: packed == each document alone, explicit backward, kernels' contracts, compile."""

from __future__ import annotations

import types

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import compilepack.backends as backends
from compilepack.ops import varlen_attention
from compilepack.ops.attention import NO_WINDOW
from tests.strategies import cu_seqlens_of, doc_lengths

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
TOLERANCE = 1e-5


def _inputs(lengths, heads=HEADS, kv_heads=KV_HEADS, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def make(h):
        return torch.randn(total, h, HEAD_DIM, generator=generator, dtype=dtype).requires_grad_()

    return make(heads), make(kv_heads), make(kv_heads)


def _alone(q, k, v, lengths, window=None, causal=True):
    """Each document through plain SDPA with an explicit mask: the definition of correct."""
    outs = []
    for qd, kd, vd in zip(*(torch.split(x, lengths) for x in (q, k, v))):
        groups = qd.shape[1] // kd.shape[1]
        qd, kd, vd = (x.transpose(0, 1) for x in (qd, kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1)))
        idx = torch.arange(qd.shape[1])
        allowed = torch.ones(len(idx), len(idx), dtype=torch.bool)
        if causal:
            allowed &= idx[:, None] >= idx[None, :]
        if window is not None:
            allowed &= (idx[:, None] - idx[None, :]).abs() < window
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=allowed).transpose(0, 1))
    return torch.cat(outs)


def _check_against_alone(lengths, window=None, causal=True, heads=HEADS, kv_heads=KV_HEADS):
    q, k, v = _inputs(lengths, heads, kv_heads)
    cu_seqlens = cu_seqlens_of(lengths)
    out = varlen_attention(q, k, v, cu_seqlens, max(lengths), causal=causal, window=window)
    expected = _alone(q, k, v, lengths, window, causal)
    assert (out - expected).abs().max().item() <= TOLERANCE
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= TOLERANCE


@given(lengths=doc_lengths(max_total=400))
@example(lengths=[1])
@example(lengths=[1] * 64)
@example(lengths=[63, 1, 64, 65])
def test_packed_equals_each_document_alone(lengths):
    _check_against_alone(lengths)


@given(lengths=doc_lengths(max_total=300), window=st.integers(1, 20))
def test_sliding_window_equals_each_document_alone(lengths, window):
    _check_against_alone(lengths, window=window)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 1), (6, 3)])
def test_bidirectional_and_head_layouts(heads, kv_heads):
    _check_against_alone([9, 1, 17], causal=False, heads=heads, kv_heads=kv_heads)
    _check_against_alone([9, 1, 17], heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("value_dim", [8, 24])
def test_value_head_dim_may_differ_from_the_query_head_dim(value_dim):
    """MLA layers use narrower values than queries; the op pads to one head dim internally, exactly."""
    lengths = [7, 1, 12]
    q, k, _ = _inputs(lengths)
    v = torch.randn(sum(lengths), KV_HEADS, value_dim, requires_grad=True)
    out = varlen_attention(q, k, v, cu_seqlens_of(lengths), 12)
    assert out.shape == (sum(lengths), HEADS, value_dim)
    expected = _alone(q, k, v, lengths)
    assert (out - expected).abs().max().item() <= TOLERANCE
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        assert (g - w).abs().max().item() <= TOLERANCE


def test_zero_length_documents_are_skipped():
    lengths = [5, 0, 7, 0, 0]
    q, k, v = _inputs(lengths)
    out = varlen_attention(q, k, v, cu_seqlens_of(lengths), 7)
    assert torch.allclose(out, _alone(q, k, v, [5, 7]), atol=TOLERANCE)


def test_max_seqlen_is_only_an_upper_bound():
    lengths = [5, 11, 3]
    q, k, v = _inputs(lengths)
    cu_seqlens = cu_seqlens_of(lengths)
    assert torch.equal(varlen_attention(q, k, v, cu_seqlens, 11), varlen_attention(q, k, v, cu_seqlens, sum(lengths)))


def test_sdpa_on_the_packed_row_leaks():
    """One causal SDPA over the packed row (what an unpatched model does without a mask) mixes documents."""
    lengths = [6, 9]
    q, k, v = _inputs(lengths, heads=2, kv_heads=2)
    whole_row = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), is_causal=True).transpose(0, 1)
    assert (whole_row - _alone(q, k, v, lengths)).abs().max().item() > 1e-2


def test_boundaries_that_do_not_cover_the_tokens_are_refused():
    q, k, v = _inputs([4, 4])
    with pytest.raises(ValueError, match="end at the token count 8"):
        varlen_attention(q, k, v, torch.tensor([0, 4, 6], dtype=torch.int32), 4)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, cu: (q[0], k, v, cu), r"\[T, heads, head_dim\]"),
        (lambda q, k, v, cu: (q, k[:, :1].expand(-1, 3, -1), v, cu), "multiple of key/value heads"),
        (lambda q, k, v, cu: (q, k, v, cu.float()), "1-D int32"),
    ],
)
def test_shape_errors_name_the_argument(change, message):
    q, k, v = _inputs([3, 5])
    with pytest.raises(ValueError, match=message):
        varlen_attention(*change(q, k, v, cu_seqlens_of([3, 5])), 5)


@pytest.mark.parametrize("lengths", [[1], [7, 1, 12], [3] * 10])
def test_opcheck(lengths):
    q, k, v = _inputs(lengths)
    cu_seqlens = cu_seqlens_of(lengths)
    args = (q, k, v, cu_seqlens, max(lengths), True, HEAD_DIM**-0.5, NO_WINDOW, "reference")
    torch.library.opcheck(torch.ops.compilepack.varlen_attention.default, args)
    out, lse = torch.ops.compilepack.varlen_attention(*args)
    backward_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *args[3:])
    torch.library.opcheck(torch.ops.compilepack.varlen_attention_backward.default, backward_args)


def _packed_call(q, k, v, cu_seqlens, max_seqlen):
    return varlen_attention(q, k, v, cu_seqlens, max_seqlen).square().sum()


def test_one_graph_forward_and_backward():
    q, k, v = _inputs([5, 9])
    cu_seqlens = cu_seqlens_of([5, 9])
    report = torch._dynamo.explain(_packed_call)(q, k, v, cu_seqlens, 9)
    assert (report.graph_count, report.graph_break_count) == (1, 0)

    def step(q, k, v, cu_seqlens, max_seqlen):
        _packed_call(q, k, v, cu_seqlens, max_seqlen).backward()

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        report = torch._dynamo.explain(step)(q, k, v, cu_seqlens, 9)
    assert (report.graph_count, report.graph_break_count) == (1, 0)


def test_compiles_once_over_varied_packings_with_matching_grads():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_packed_call, backend=counter, fullgraph=True, dynamic=True)
    for lengths in ([5, 9], [3, 3, 3, 7], [40], [1, 2, 3, 4, 5, 6], [17, 2], [8] * 9):
        q, k, v = _inputs(lengths)
        cu_seqlens = cu_seqlens_of(lengths)
        got = torch.autograd.grad(compiled(q, k, v, cu_seqlens, max(lengths)), (q, k, v))
        want = torch.autograd.grad(_packed_call(q, k, v, cu_seqlens, max(lengths)), (q, k, v))
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-5)
    assert counter.frame_count == 1


# ------------------------------------------------------------------------------------ CUDA paths, with fakes


class _RecordingKernels:
    """Stands in for a CUDA attention library: checks the argument contract, answers with the reference."""

    def __init__(self):
        self.calls = []

    def check_common(self, q, k, v, cu_q, cu_k, max_q, max_k):
        for x in (q, k, v):
            assert x.is_contiguous() and x.dim() == 3
        assert cu_q.dtype == torch.int32 and cu_q is cu_k or torch.equal(cu_q, cu_k)
        assert type(max_q) is int and type(max_k) is int and max_q == max_k

    # flash-attn: flash_attn.flash_attn_interface
    def _flash_attn_varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal,
                                   window_size_left, window_size_right, softcap, alibi_slopes, return_softmax):
        self.check_common(q, k, v, cu_q, cu_k, max_q, max_k)
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and return_softmax is False
        assert window_size_right == (0 if causal else window_size_left)
        self.calls.append("flash_forward")
        out, lse = torch.ops.compilepack.varlen_attention(q, k, v, cu_q, max_q, causal, softmax_scale,
                                                          window_size_left, "reference")
        return out, lse, None, None

    def _flash_attn_varlen_backward(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, *,
                                    dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                                    alibi_slopes, deterministic, rng_state):
        self.check_common(q, k, v, cu_q, cu_k, max_q, max_k)
        assert dout.is_contiguous() and lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
        self.calls.append("flash_backward")
        grads = torch.ops.compilepack.varlen_attention_backward(
            dout, q, k, v, out, lse, cu_q, max_q, causal, softmax_scale, window_size_left, "reference")
        for buffer, grad in zip((dq, dk, dv), grads):  # flash-attn writes into the buffers it is given
            buffer.copy_(grad)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    fake = _RecordingKernels()
    monkeypatch.setattr(backends, "use_kernel", lambda tensor, backend: backend != backends.REFERENCE)
    monkeypatch.setattr(backends, "load", lambda name: fake if name.startswith("flash_attn") else types.SimpleNamespace())
    return fake


@pytest.mark.parametrize("window", [None, 4])
def test_flash_attn_path_contract(kernels_on_cpu, window):
    lengths = [6, 1, 11]
    q, k, v = _inputs(lengths)
    cu_seqlens = cu_seqlens_of(lengths)
    out = varlen_attention(q, k, v, cu_seqlens, 11, window=window, backend="flash_attn")
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert kernels_on_cpu.calls == ["flash_forward", "flash_backward"]
    expected = _alone(q, k, v, lengths, window)
    assert torch.allclose(out, expected, atol=TOLERANCE)
    for g, w in zip(got, torch.autograd.grad(expected.square().sum(), (q, k, v))):
        assert torch.allclose(g, w, atol=TOLERANCE)


def test_torch_varlen_path_contract(monkeypatch):
    calls = []

    def fake_forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, window, enable_gqa, seqused, table, splits):
        assert q.is_contiguous() and cu_q.dtype == torch.int32 and type(max_q) is int
        assert enable_gqa == (q.shape[1] != k.shape[1]) and seqused is None and table is None
        assert is_causal and window == [-1, -1]
        calls.append("forward")
        out, lse = torch.ops.compilepack.varlen_attention(q, k, v, cu_q, max_q, True, scale, NO_WINDOW, "reference")
        return out, lse, torch.zeros(2, dtype=torch.uint64)

    def fake_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng_state, scale, window):
        assert rng_state.dtype == torch.uint64 and is_causal and type(max_k) is int
        calls.append("backward")
        return torch.ops.compilepack.varlen_attention_backward(
            dout, q, k, v, out, lse, cu_q, max_q, True, scale, NO_WINDOW, "reference")

    fake_ops = types.SimpleNamespace(_varlen_attn=fake_forward, _varlen_attn_backward=fake_backward)
    monkeypatch.setattr(backends, "use_kernel", lambda tensor, backend: backend != backends.REFERENCE)
    monkeypatch.setattr(backends, "load", lambda name: types.SimpleNamespace())
    monkeypatch.setattr(torch.ops, "torch_attn", fake_ops, raising=False)
    lengths = [4, 9]
    q, k, v = _inputs(lengths)
    out = varlen_attention(q, k, v, cu_seqlens_of(lengths), 9, backend="torch_varlen")
    got = torch.autograd.grad(out.sum(), (q, k, v))
    assert calls == ["forward", "backward"]
    expected = _alone(q, k, v, lengths)
    assert torch.allclose(out, expected, atol=TOLERANCE)
    for g, w in zip(got, torch.autograd.grad(expected.sum(), (q, k, v))):
        assert torch.allclose(g, w, atol=TOLERANCE)
