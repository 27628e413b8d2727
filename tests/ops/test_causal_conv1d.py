"""compilepack::causal_conv1d_varlen: packed == each document alone, stock leaks, compiles once, kernel contract."""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch
import torch._dynamo.testing
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn as stock_causal_conv1d_fn

from compilepack import backends
from compilepack.ops import causal_conv1d as conv_module
from compilepack.ops.causal_conv1d import causal_conv1d_varlen
from tests.strategies import doc_lengths, seq_idx_of, split_docs

# fp32. Outputs and dx sum O(W) terms: 1e-5 absolute. dweight and dbias sum over every token of the row (up to
# 640 here), in another order than the per-document loop: 1e-5 relative to their largest entry.
ATOL = 1e-5
DIM = 8  # a multiple of 8, so the CUDA-path tests can use the same shapes


def make_inputs(lengths, dim=DIM, width=4, batch=1, dtype=torch.float32, seed=0, bias=True):
    """x channel-last [B, D, T] as transformers passes it, weight [D, W], bias [D], all requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = torch.randn(batch, total, dim, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    weight = torch.randn(dim, width, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(dim, generator=gen, dtype=dtype).requires_grad_() if bias else None
    return x, weight, b


def params(x, weight, bias):
    return [t for t in (x, weight, bias) if t is not None]


def grads_of(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def per_document(x, weight, bias, lengths, activation):
    """Each document run alone through the stock transformers function, then concatenated."""
    pieces = [stock_causal_conv1d_fn(doc, weight, bias, activation=activation) for doc in split_docs(x, lengths, 2)]
    return torch.cat(pieces, dim=2)


def assert_close(actual, expected, atol=ATOL):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= atol, f"max abs error {err:.3g} > {atol}"


def assert_grads_close(got, want, atol=ATOL):
    """x-gradient absolute; parameter gradients (reductions over tokens) relative to their largest entry."""
    assert_close(got[0], want[0], atol)
    for g, w in zip(got[1:], want[1:]):
        assert_close(g, w, atol * max(1.0, w.abs().max().item()))


def plain_conv(path):
    """Force the reference onto one implementation: the boundary-blind conv as W multiply-adds or conv2d (the
    default picks by size), or the sync-free masked corrections used off the CPU (no ``nonzero``)."""
    if path == "sync_free":
        return mock.patch.object(conv_module, "_sync_free", lambda tensor: True)
    threshold = {"conv2d": 0, "multiply_adds": 1 << 62}[path]
    return mock.patch.object(conv_module, "CONV2D_MIN_ELEMENTS", threshold)


PLAIN_CONVS = ["multiply_adds", "conv2d", "sync_free"]


# ---------------------------------------------------------------------------------------------------------
# packed == per document


@given(
    lengths=doc_lengths(),
    width=st.sampled_from([2, 3, 4]),
    activation=st.sampled_from([None, "silu"]),
    path=st.sampled_from(PLAIN_CONVS),
)
def test_packed_equals_documents_alone(lengths, width, activation, path):
    x, weight, bias = make_inputs(lengths, width=width)
    seq_idx = seq_idx_of(lengths)
    with plain_conv(path):
        out = causal_conv1d_varlen(x, weight, bias, seq_idx, activation)
    expected = per_document(x, weight, bias, lengths, activation)
    assert_close(out, expected)
    grad_out = torch.randn_like(expected)
    with plain_conv(path):
        grads = grads_of(out, (x, weight, bias), grad_out)
    assert_grads_close(grads, grads_of(expected, (x, weight, bias), grad_out))


@pytest.mark.parametrize("path", PLAIN_CONVS)
@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize(
    "lengths",
    [[1], [1, 1, 1, 1, 1], [2, 1, 3, 1, 9], [3, 3, 3], [1, 20], [20, 1], [4, 4, 1, 2, 5]],
    ids=["one-token", "all-one-token", "shorter-than-W", "W-1", "1-then-long", "long-then-1", "mixed"],
)
def test_short_documents(lengths, activation, path):
    """1-token documents and documents shorter than W never see a previous document's taps (float64)."""
    x, weight, bias = make_inputs(lengths, width=4, dtype=torch.float64)
    with plain_conv(path):
        out = causal_conv1d_varlen(x, weight, bias, seq_idx_of(lengths), activation)
        expected = per_document(x, weight, bias, lengths, "silu" if activation else None)
        assert_close(out, expected, atol=1e-12)
        grad_out = torch.randn_like(expected)
        got, want = grads_of(out, (x, weight, bias), grad_out), grads_of(expected, (x, weight, bias), grad_out)
    assert_grads_close(got, want, atol=1e-12)


@pytest.mark.parametrize("path", PLAIN_CONVS)
def test_rows_are_independent_with_global_ids(path):
    """B > 1: every row starts a document, even when its first id continues the previous row's last id."""
    rows = [[3, 5, 1], [2, 7]]  # 9 tokens each
    seq_idx = torch.tensor([[0] * 3 + [1] * 5 + [2], [2] * 2 + [3] * 7], dtype=torch.int32)  # id 2 spans both rows
    x, weight, bias = make_inputs([9], batch=2, width=3)
    with plain_conv(path):
        out = causal_conv1d_varlen(x, weight, bias, seq_idx, "silu")
        grad_out = torch.randn_like(out)
        got = grads_of(out, (x, weight, bias), grad_out)
    expected = torch.cat([per_document(x[i : i + 1], weight, bias, rows[i], "silu") for i in range(2)])
    assert_close(out, expected)
    assert_grads_close(got, grads_of(expected, (x, weight, bias), grad_out))


@pytest.mark.parametrize("activation", [None, "silu"])
def test_plain_conv_paths_agree_at_model_size(activation):
    """At a real layer size the default picks conv2d; the multiply-adds and the sync-free corrections agree
    with it (fp32, B = 2)."""
    lengths = [100, 1, 3, 200, 40]
    x, weight, bias = make_inputs(lengths, batch=2, dim=1024)
    seq_idx = seq_idx_of(lengths).expand(2, -1)
    assert x.numel() >= conv_module.CONV2D_MIN_ELEMENTS
    grad_out = torch.randn(2, sum(lengths), 1024).transpose(1, 2)
    results = {}
    for path in PLAIN_CONVS:
        with plain_conv(path):
            out = causal_conv1d_varlen(x, weight, bias, seq_idx, activation)
            results[path] = (out, *grads_of(out, (x, weight, bias), grad_out))
    (out_a, *grads_a), *others = results.values()
    for out_b, *grads_b in others:
        assert_close(out_a, out_b)
        assert_grads_close(grads_a, grads_b)


def test_without_bias_weight_and_x_grads():
    lengths = [5, 1, 7]
    x, weight, _ = make_inputs(lengths, bias=False)
    out = causal_conv1d_varlen(x, weight, None, seq_idx_of(lengths), "silu")
    expected = per_document(x, weight, None, lengths, "silu")
    assert_close(out, expected)
    grad_out = torch.randn_like(expected)
    assert_grads_close(grads_of(out, (x, weight), grad_out), grads_of(expected, (x, weight), grad_out))


def test_frozen_conv_weights_x_grad_only():
    """A frozen conv (weight and bias without grad) still gives the exact x gradient."""
    lengths = [6, 1, 2, 9]
    x, weight, bias = make_inputs(lengths)
    weight, bias = weight.detach(), bias.detach()
    out = causal_conv1d_varlen(x, weight, bias, seq_idx_of(lengths), "silu")
    expected = per_document(x, weight, bias, lengths, "silu")
    grad_out = torch.randn_like(expected)
    assert_close(grads_of(out, (x,), grad_out)[0], grads_of(expected, (x,), grad_out)[0])


def test_gradcheck_float64():
    lengths = [3, 1, 5]
    x, weight, bias = make_inputs(lengths, width=3, dtype=torch.float64)
    seq_idx = seq_idx_of(lengths)

    def conv(x, weight, bias):
        return causal_conv1d_varlen(x, weight, bias, seq_idx, "silu")

    assert torch.autograd.gradcheck(conv, (x, weight, bias), fast_mode=True)


# ---------------------------------------------------------------------------------------------------------
# stock transformers: leaks on a packed row, identical on one document


def test_stock_leaks_across_documents():
    lengths = [6, 5, 7]
    x, weight, bias = make_inputs(lengths)
    stock = stock_causal_conv1d_fn(x, weight, bias, activation="silu")
    ours = causal_conv1d_varlen(x, weight, bias, seq_idx_of(lengths), "silu")
    first_doc = lengths[0]
    assert_close(stock[..., :first_doc], ours[..., :first_doc])
    assert (stock[..., first_doc:] - ours[..., first_doc:]).abs().max() > 1e-2


@pytest.mark.parametrize("activation", [None, "silu"])
def test_single_document_equals_stock(activation):
    x, weight, bias = make_inputs([37], batch=2, dim=16)
    seq_idx = torch.tensor([[4] * 37, [5] * 37], dtype=torch.int32)
    out = causal_conv1d_varlen(x, weight, bias, seq_idx, activation)
    stock = stock_causal_conv1d_fn(x, weight, bias, activation=activation)
    assert_close(out, stock)
    grad_out = torch.randn_like(stock)
    assert_grads_close(grads_of(out, (x, weight, bias), grad_out), grads_of(stock, (x, weight, bias), grad_out))


# ---------------------------------------------------------------------------------------------------------
# layout and dtypes


@pytest.mark.parametrize("layout", ["channel_last", "contiguous", "sliced"])
def test_output_and_dx_are_channel_last(layout):
    lengths = [4, 6]
    x_cl, weight, bias = make_inputs(lengths, batch=2)
    x = {
        "channel_last": x_cl,
        "contiguous": x_cl.detach().contiguous().requires_grad_(),
        "sliced": torch.randn(2, 10, 3 * DIM).transpose(1, 2)[:, DIM : 2 * DIM].requires_grad_(),
    }[layout]
    seq_idx = seq_idx_of(lengths).expand(2, -1)
    out = causal_conv1d_varlen(x, weight, bias, seq_idx, "silu")
    channel_last = (10 * DIM, 1, DIM)
    assert out.stride() == channel_last
    (dx,) = torch.autograd.grad(out, x, torch.randn_like(out))
    assert dx.stride() == channel_last
    assert_close(out, per_document(x, weight, bias, lengths, "silu"))


def test_bfloat16_returns_input_dtype():
    lengths = [5, 9]
    x, weight, bias = make_inputs(lengths, dtype=torch.bfloat16)
    out = causal_conv1d_varlen(x, weight, bias, seq_idx_of(lengths), "silu")
    assert out.dtype == torch.bfloat16
    expected = per_document(x.float(), weight.float(), bias.float(), lengths, "silu")
    assert_close(out.float(), expected, atol=3e-2)  # one bf16 rounding of values of magnitude ~4
    dx, dweight, dbias = grads_of(out, (x, weight, bias), torch.ones_like(out))
    assert (dx.dtype, dweight.dtype, dbias.dtype) == (torch.bfloat16,) * 3


# ---------------------------------------------------------------------------------------------------------
# custom-op checks and compile


PACKINGS = [[1], [2, 1, 5], [9, 1, 1, 3], [4] * 4]


@pytest.mark.parametrize("lengths", PACKINGS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck_forward(lengths, with_bias):
    x, weight, bias = make_inputs(lengths, batch=2, bias=with_bias)
    seq_idx = seq_idx_of(lengths).expand(2, -1).contiguous()
    args = (x, weight, bias, seq_idx, True, "reference")
    torch.library.opcheck(torch.ops.compilepack.causal_conv1d_varlen.default, args)


@pytest.mark.parametrize("lengths", PACKINGS)
@pytest.mark.parametrize("silu, weight_grads", [(True, True), (False, True), (True, False)])
def test_opcheck_backward(lengths, silu, weight_grads):
    x, weight, bias = (t.detach() for t in make_inputs(lengths, batch=2))
    seq_idx = seq_idx_of(lengths).expand(2, -1).contiguous()
    grad_out = torch.randn(2, sum(lengths), DIM).transpose(1, 2)
    torch.library.opcheck(
        torch.ops.compilepack.causal_conv1d_varlen_backward.default,
        (grad_out, x, weight, bias, seq_idx, silu, weight_grads, "reference"),
    )


def conv_silu(x, weight, bias, seq_idx):
    return causal_conv1d_varlen(x, weight, bias, seq_idx, "silu")


def conv_silu_grads(x, weight, bias, seq_idx):
    out = causal_conv1d_varlen(x, weight, bias, seq_idx, "silu")
    return torch.autograd.grad(out.square().sum(), (x, weight, bias))


def test_explain_one_graph_forward_and_backward():
    lengths = [3, 1, 6]
    args = (*make_inputs(lengths), seq_idx_of(lengths))
    forward = torch._dynamo.explain(conv_silu)(*args)
    assert (forward.graph_count, forward.graph_break_count) == (1, 0)
    # autograd.grad inside the traced function needs this flag (off by default: it is a graph break otherwise)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        both = torch._dynamo.explain(conv_silu_grads)(*args)
    assert (both.graph_count, both.graph_break_count) == (1, 0)


def test_compiles_once_over_changing_lengths_and_document_counts():
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(conv_silu, fullgraph=True, dynamic=True, backend=counter)
    # first T (9) differs from D (8) and W (4): duck sizing would otherwise share one symbol and recompile
    packings = [[5, 4], [1, 1, 1, 9, 2], [17], [2] * 11, [30, 1, 4], [6, 6, 6, 6, 6, 6, 7]]
    for lengths in packings:
        x, weight, bias = make_inputs(lengths)
        out = compiled(x, weight, bias, seq_idx_of(lengths))
        assert_close(out, per_document(x, weight, bias, lengths, "silu"))
    assert counter.frame_count == 1


def test_aot_eager_forward_backward_matches_eager():
    lengths = [7, 1, 2, 12]
    x, weight, bias = make_inputs(lengths)
    seq_idx = seq_idx_of(lengths)
    compiled = torch.compile(conv_silu, fullgraph=True, dynamic=True, backend="aot_eager")
    out = compiled(x, weight, bias, seq_idx)
    grad_out = torch.randn_like(out)
    eager = conv_silu(x, weight, bias, seq_idx)
    assert out.stride() == eager.stride()
    assert_close(out, eager, atol=0.0)
    inputs = (x, weight, bias)
    assert_grads_close(grads_of(out, inputs, grad_out), grads_of(eager, inputs, grad_out), atol=0.0)


# ---------------------------------------------------------------------------------------------------------
# CUDA kernel path, driven on CPU with a fake causal-conv1d that checks the argument contract


def assert_channel_last_for_kernel(t, name):
    assert t.stride(1) == 1 and t.stride(2) > 1, f"{name} must be channel-last, strides {t.stride()}"
    assert t.stride(0) % 8 == 0 and t.stride(2) % 8 == 0 and t.shape[1] % 8 == 0, f"{name} strides {t.stride()}"


class FakeCausalConv1d:
    """Records calls; asserts what causal_conv1d 1.6.1 checks (csrc/causal_conv1d.cpp); returns the reference."""

    def __init__(self):
        self.calls = []
        self.root = types.SimpleNamespace(causal_conv1d_fn=self.causal_conv1d_fn)
        self.cpp_functions = types.SimpleNamespace(causal_conv1d_bwd_function=self.causal_conv1d_bwd_function)

    def load(self, module_name):
        return {"causal_conv1d": self.root, "causal_conv1d.cpp_functions": self.cpp_functions}[module_name]

    def check_common(self, x, weight, bias, seq_idx):
        batch, dim, seqlen = x.shape
        assert_channel_last_for_kernel(x, "x")
        assert weight.shape == (dim, weight.shape[1]) and 2 <= weight.shape[1] <= 4
        assert bias is None or (bias.dtype == weight.dtype and bias.stride(-1) == 1)
        assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (batch, seqlen)
        assert seq_idx.device == x.device

    def causal_conv1d_fn(self, x, weight, bias=None, seq_idx=None, activation=None):
        self.calls.append("fwd")
        self.check_common(x, weight, bias, seq_idx)
        assert activation in (None, "silu")
        out = torch.empty_like(x)  # what the library allocates
        return out.copy_(conv_module.reference_forward(x, weight, bias, seq_idx, activation == "silu"))

    def causal_conv1d_bwd_function(self, x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
                                   return_dinitial_states, silu_activation):
        self.calls.append("bwd")
        self.check_common(x, weight, bias, seq_idx)
        assert_channel_last_for_kernel(dout, "dout")
        assert dout.dtype == x.dtype
        assert initial_states is None and dfinal_states is None and dx is None
        assert return_dinitial_states is False and isinstance(silu_activation, bool)
        ref_dx, ref_dweight, ref_dbias = conv_module.reference_backward(dout, x, weight, bias, seq_idx, silu_activation)
        dx = torch.empty_like(x).copy_(ref_dx)
        return dx, ref_dweight, (ref_dbias if bias is not None else None), None


@pytest.fixture
def fake_kernel(monkeypatch):
    fake = FakeCausalConv1d()
    monkeypatch.setattr(backends, "use_kernel", lambda tensor, backend: backend == "causal_conv1d")
    monkeypatch.setattr(backends, "load", fake.load)
    return fake


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("layout", ["channel_last", "contiguous"])
def test_kernel_path_contract_and_result(fake_kernel, with_bias, layout):
    lengths = [5, 1, 2, 8]
    x, weight, bias = make_inputs(lengths, batch=2, dim=16, bias=with_bias)
    if layout == "contiguous":
        x = x.detach().contiguous().requires_grad_()
    seq_idx = seq_idx_of(lengths).expand(2, -1)  # an expanded (non-contiguous) view: the op must fix it
    inputs = params(x, weight, bias)
    out = causal_conv1d_varlen(x, weight, bias, seq_idx, "silu", backend="causal_conv1d")
    grad_out = torch.randn(2, sum(lengths), 16).transpose(1, 2)
    kernel_grads = grads_of(out, inputs, grad_out)
    assert fake_kernel.calls == ["fwd", "bwd"]
    expected = causal_conv1d_varlen(x, weight, bias, seq_idx, "silu")
    assert out.stride() == expected.stride() and kernel_grads[0].stride() == expected.stride()
    assert_close(out, expected, atol=0.0)
    assert_grads_close(kernel_grads, grads_of(expected, inputs, grad_out), atol=0.0)


def test_kernel_path_falls_back_for_unsupported_shapes(fake_kernel):
    lengths = [3, 4]
    x, weight, bias = make_inputs(lengths, dim=6)  # D % 8 != 0: the kernel refuses it
    out = causal_conv1d_varlen(x, weight, bias, seq_idx_of(lengths), "silu", backend="causal_conv1d")
    out.sum().backward()
    assert fake_kernel.calls == []
    assert_close(out, per_document(x, weight, bias, lengths, "silu"))


def test_kernel_path_compiles_with_aot_eager(fake_kernel):
    lengths = [4, 1, 11]
    x, weight, bias = make_inputs(lengths)

    def fn(x, weight, bias, seq_idx):
        return causal_conv1d_varlen(x, weight, bias, seq_idx, "silu", backend="causal_conv1d")

    out = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")(x, weight, bias, seq_idx_of(lengths))
    out.sum().backward()
    assert fake_kernel.calls == ["fwd", "bwd"]
    assert_close(out, per_document(x, weight, bias, lengths, "silu"))


# ---------------------------------------------------------------------------------------------------------
# errors checkable from shapes and dtypes


def test_argument_errors_name_the_argument():
    lengths = [3, 5]
    x, weight, bias = make_inputs(lengths)
    seq_idx = seq_idx_of(lengths)
    cases = [
        ((x[0], weight, bias, seq_idx), "x must be a float [B, D, T]"),
        ((x.detach().long(), weight, bias, seq_idx), "x must be a float [B, D, T]"),
        ((x, weight.unsqueeze(1), bias, seq_idx), "weight must be a float [D, W]"),
        ((x, weight[:4], bias, seq_idx), "weight must be a float [D, W] tensor with D=8"),
        ((x, weight, bias[:3], seq_idx), "bias must be None or a float [D]"),
        ((x, weight, bias, seq_idx[:, :-1]), r"seq_idx must have shape [B, T] = (1, 8)"),
        ((x, weight, bias, seq_idx[0]), "seq_idx must have shape"),
        ((x, weight, bias, seq_idx.float()), "seq_idx must be an integer tensor"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as info:
            causal_conv1d_varlen(*args)
        assert message in str(info.value)
    with pytest.raises(ValueError, match="activation must be one of"):
        causal_conv1d_varlen(x, weight, bias, seq_idx, "gelu")
