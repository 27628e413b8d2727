"""compilepack::gated_delta_rule_varlen: exact on packed rows, equal to transformers on one document, explicit
backward checked against an fp64 token-by-token recurrence, one graph under torch.compile, and the fla path
driven on CPU through a fake fla module that checks the argument contract.

Tolerances: the op computes in fp32 (as transformers does). Outputs and gradients are compared with an absolute
bound of 1e-5 scaled by the largest magnitude of the reference tensor (at least 1): the chunked algorithm sums
O(K * chunk) fp32 products per entry, so the error grows with the entry size, not with the token count.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from hypothesis import given
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from compilepack import backends
from compilepack.ops import gated_delta_rule as gdr
from compilepack.ops.gated_delta_rule import gated_delta_rule_varlen
from tests.compiling import graphs_compiled
from tests.strategies import cu_seqlens_of, doc_lengths

H, HV, K, V = 2, 4, 16, 8  # grouped value heads (HV = 2 H) so the repeat_interleave mapping is exercised
FP32_TOL = 1e-5


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


def run_stock(inputs, do):
    q, k, v, g, beta = inputs
    o = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    return o.detach(), list(torch.autograd.grad(o, inputs, do))


def assert_close(actual, expected, what: str, tol: float = FP32_TOL):
    bound = tol * max(1.0, expected.abs().max().item())
    err = (actual - expected).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def docs_alone(inputs, lengths, do):
    """The stock function on every document separately: the ground truth a packed row must reproduce.

    The documents run as one right-padded batch: the rule is causal, so padding after a document changes none of
    its outputs, and the padded outputs get a zero gradient, so they add nothing to the gradients either.
    """
    lengths = [n for n in lengths if n > 0]
    pieces = [[x[0, s : s + n] for s, n in zip(starts_of(lengths), lengths)] for x in (*inputs, do)]
    batch = [torch.nn.utils.rnn.pad_sequence(p, batch_first=True).detach().requires_grad_() for p in pieces]
    o, grads = run_stock(batch[:5], batch[5])
    unpad = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]  # noqa: E731
    return unpad(o), [unpad(g) for g in grads]


def starts_of(lengths):
    return [sum(lengths[:i]) for i in range(len(lengths))]


# --------------------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------------------


@given(lengths=doc_lengths())
def test_packed_equals_each_document_alone(lengths):
    inputs = make_inputs(sum(lengths), seed=len(lengths))
    o, grads, do = run_op(inputs, cu_seqlens_of(lengths))
    o_ref, grads_ref = docs_alone(inputs, lengths, do)
    assert_close(o, o_ref, "output")
    for name, got, ref in zip("q k v g beta".split(), grads, grads_ref):
        assert_close(got, ref, f"d{name}")


@pytest.mark.parametrize("heads, dims", [((H, HV), (K, V)), ((3, 3), (8, 16)), ((1, 4), (16, 16))])
def test_single_document_equals_stock_function(heads, dims):
    inputs = make_inputs(150, heads=heads, dims=dims)
    o, grads, do = run_op(inputs, cu_seqlens_of([150]))
    o_ref, grads_ref = run_stock(inputs, do)
    assert_close(o, o_ref, "output")
    for name, got, ref in zip("q k v g beta".split(), grads, grads_ref):
        assert_close(got, ref, f"d{name}")


def test_batch_rows_are_documents():
    """B > 1: each row edge is a document edge, so B rows equal the stock function's batch of B sequences."""
    inputs = make_inputs(70, batch=3)
    o, grads, do = run_op(inputs, cu_seqlens_of([70, 70, 70]))
    o_ref, grads_ref = run_stock(inputs, do)
    assert_close(o, o_ref, "output")
    for name, got, ref in zip("q k v g beta".split(), grads, grads_ref):
        assert_close(got, ref, f"d{name}")


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
    o_packed_stock, _ = run_stock(inputs, do)
    o_ref, _ = docs_alone(inputs, lengths, do)
    o_op, _, _ = run_op(inputs, cu_seqlens_of(lengths))
    leak = (o_packed_stock[:, 50:] - o_ref[:, 50:]).abs().max().item()
    assert leak > 1e-2, f"stock function should leak on a packed row, max difference only {leak:.3g}"
    assert torch.equal(o_packed_stock[:, :50], o_packed_stock[:, :50])  # the first document is unaffected
    assert_close(o_op, o_ref, "op output")


def naive_recurrence_fp64(q, k, v, g, beta, lengths, scale):
    """Token-by-token gated delta rule in fp64, state zeroed per document: the independent exact answer."""
    q, k = F.normalize(q, dim=-1, eps=0) * scale, F.normalize(k, dim=-1, eps=0)
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    outs, start = [], 0
    for length in lengths:
        state = q.new_zeros(v.shape[2], q.shape[-1], v.shape[-1])
        for t in range(start, start + length):
            state = state * g[0, t].exp()[:, None, None]
            delta = v[0, t] - torch.einsum("hkv,hk->hv", state, k[0, t])
            state = state + torch.einsum("hk,hv->hkv", k[0, t], delta * beta[0, t][:, None])
            outs.append(torch.einsum("hkv,hk->hv", state, q[0, t]))
        start += length
    return torch.stack(outs)[None]


def test_gradients_match_fp64_recurrence():
    """The hand-derived backward against autograd through an fp64 token loop, relative to the largest entry
    (measured: <= 7e-7 of it for every gradient; fp32 is the op's compute precision)."""
    lengths = [5, 70, 1, 60]
    inputs = make_inputs(sum(lengths), seed=3)
    o, grads, do = run_op(inputs, cu_seqlens_of(lengths))
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    o64 = naive_recurrence_fp64(*inputs64, lengths, K**-0.5)
    grads64 = torch.autograd.grad(o64, inputs64, do.double())
    assert_close(o.double(), o64, "output", tol=1e-5)
    for name, got, ref in zip("q k v g beta".split(), grads, grads64):
        assert_close(got.double(), ref, f"d{name}", tol=1e-5)


def test_without_l2norm_and_custom_scale():
    lengths = [40, 30]
    inputs = make_inputs(sum(lengths), seed=5)
    q, k = (F.normalize(x.detach(), dim=-1).requires_grad_() for x in inputs[:2])
    plain = [q, k, *inputs[2:]]
    o, grads, do = run_op(plain, cu_seqlens_of(lengths), use_qk_l2norm=False, scale=0.3)
    o64 = naive_recurrence_fp64(*[x.detach().double() for x in plain], lengths, 0.3)
    assert_close(o.double(), o64, "output")
    o_def, _, _ = run_op(plain, cu_seqlens_of(lengths), use_qk_l2norm=False)
    o_def64 = naive_recurrence_fp64(*[x.detach().double() for x in plain], lengths, K**-0.5)
    assert_close(o_def.double(), o_def64, "output (default scale)")


def test_bfloat16_inputs_keep_their_dtype():
    inputs = make_inputs(80, dtype=torch.bfloat16)
    o, grads, _ = run_op(inputs, cu_seqlens_of([20, 60]))
    assert o.dtype == torch.bfloat16 and o.shape == (1, 80, HV, V)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 5


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[64], [1, 63, 64, 2], [10, 0, 30]])
def test_opcheck(lengths):
    inputs = make_inputs(sum(lengths), seed=2)
    cu = cu_seqlens_of(lengths) if 0 not in lengths else torch.tensor([0, 10, 10, 40], dtype=torch.int32)
    args = (*inputs, cu, True, K**-0.5, backends.REFERENCE)
    torch.library.opcheck(gdr._gated_delta_rule_op, args)
    o, saved = gdr._gated_delta_rule_op(*args)
    # the backward op has no double backward: check it on plain tensors
    plain = [x.detach() for x in (torch.randn_like(o), *inputs)]
    torch.library.opcheck(gdr._gated_delta_rule_backward_op, (*plain, cu, saved, True, K**-0.5, backends.REFERENCE))


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
    for name, got, ref in zip("q k v g beta".split(), grads, grads_eager):
        assert_close(got, ref, f"d{name}", tol=1e-6)


# --------------------------------------------------------------------------------------------------------------
# CUDA path on CPU: a fake fla module that checks fla's argument contract and returns reference results
# --------------------------------------------------------------------------------------------------------------


class FakeFla(types.SimpleNamespace):
    """Stands in for ``fla.ops.gated_delta_rule.chunk`` (fla 0.6.0, API shared with 0.5.x); records every call."""

    def __init__(self, total: int):
        super().__init__(calls=[], total=total)

    @staticmethod
    def _packed_row(x, *trailing_dims):
        assert x.dim() == 2 + len(trailing_dims) and x.shape[0] == 1, f"fla varlen wants [1, T, ...], got {x.shape}"
        assert x.is_contiguous(), "fla kernels index raw pointers: inputs must be contiguous"

    def l2norm_fwd(self, x):
        self.calls.append("l2norm_fwd")
        self._packed_row(x, 0, 0)
        rstd = torch.rsqrt(x.float().square().sum(-1) + 1e-6)
        return (x * rstd[..., None]).to(x.dtype), rstd

    def l2norm_bwd(self, y, rstd, dy):
        self.calls.append("l2norm_bwd")
        assert rstd.dtype == torch.float32 and rstd.shape == y.shape[:-1]
        return rstd[..., None] * (dy - (dy * y).sum(-1, keepdim=True) * y)

    def prepare_chunk_indices(self, cu_seqlens, chunk_size):
        self.calls.append("prepare_chunk_indices")
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
        assert type(chunk_size) is int and chunk_size == 64
        return torch.zeros(3, 2, dtype=torch.int32)

    def _check(self, q, k, v, g, beta, scale, cu_seqlens, chunk_indices, initial_state):
        for x in (q, k, v):
            self._packed_row(x, 0, 0)
        for x in (g, beta):
            self._packed_row(x, 0)
        assert q.shape[1] == self.total and v.shape[2] % q.shape[2] == 0  # fla handles HV > H itself (GVA)
        assert type(scale) is float and initial_state is None
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device
        assert chunk_indices is not None, "pass chunk indices so fla does not rebuild them"

    # only the arguments fla 0.5.x and 0.6.0 share: passing any other one fails here with a TypeError
    def chunk_gated_delta_rule_fwd(
        self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices
    ):
        self.calls.append("fwd")
        self._check(q, k, v, g, beta, scale, cu_seqlens, chunk_indices, initial_state)
        assert output_final_state is False
        o, _ = gdr._reference_forward(q, k, v, g, beta, cu_seqlens, False, scale)
        A = k.new_zeros(*v.shape[:3], 64)
        g_cum = g.float() * 1.0  # stands for fla's chunk-local cumsum; the fake backward reads it back as g
        return g_cum, o.to(v.dtype), A, None, None, None

    def chunk_gated_delta_rule_bwd(self, q, k, v, g, beta, A, scale, initial_state, do, dht, cu_seqlens, chunk_indices):
        self.calls.append("bwd")
        self._check(q, k, v, g, beta, scale, cu_seqlens, chunk_indices, initial_state)
        assert g.dtype == torch.float32 and A.shape == (*v.shape[:3], 64) and dht is None
        _, saved = gdr._reference_forward(q, k, v, g, beta, cu_seqlens, False, scale)
        dq, dk, dv, dg, db = gdr._reference_backward(do, q, k, v, g, beta, cu_seqlens, saved, False, scale)
        return dq, dk, dv, db, dg, None, None, None


@pytest.fixture
def fake_fla(monkeypatch):
    fakes = {}

    def load(name):
        assert name == "fla.ops.gated_delta_rule.chunk"
        return fakes["fla"]

    monkeypatch.setattr(backends, "use_kernel", lambda tensor, backend: backend == "fla")
    monkeypatch.setattr(backends, "load", load)
    return fakes


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_fla_path_contract_and_results(fake_fla, use_qk_l2norm):
    lengths = [40, 1, 70]
    inputs = make_inputs(sum(lengths), batch=1, seed=4)
    cu = cu_seqlens_of(lengths)
    fake_fla["fla"] = fake = FakeFla(sum(lengths))
    o, grads, do = run_op(inputs, cu, use_qk_l2norm=use_qk_l2norm, backend="fla")
    forward = ["l2norm_fwd"] * 2 * use_qk_l2norm + ["prepare_chunk_indices", "fwd"]
    assert fake.calls == forward + ["prepare_chunk_indices", "bwd"] + ["l2norm_bwd"] * 2 * use_qk_l2norm
    o_ref, grads_ref, _ = run_op(inputs, cu, use_qk_l2norm=use_qk_l2norm, backend="reference")
    assert_close(o, o_ref, "output")
    for name, got, ref in zip("q k v g beta".split(), grads, grads_ref):
        assert_close(got, ref, f"d{name}")


def test_fla_path_flattens_batch_rows_and_passes_opcheck(fake_fla):
    inputs = make_inputs(70, batch=2, seed=6)
    cu = cu_seqlens_of([70, 70])
    fake_fla["fla"] = FakeFla(140)
    args = (*inputs, cu, True, K**-0.5, "fla")
    torch.library.opcheck(gdr._gated_delta_rule_op, args)  # the fake's saved shapes match fla's
    o, saved = gdr._gated_delta_rule_op(*args)
    assert [tuple(s.shape) for s in saved] == [(2, 70, H, K), (2, 70, H), (2, 70, H, K), (2, 70, H), (2, 70, HV), (2, 70, HV, 64)]
    plain = [x.detach() for x in (torch.randn_like(o), *inputs)]
    torch.library.opcheck(gdr._gated_delta_rule_backward_op, (*plain, cu, saved, True, K**-0.5, "fla"))


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
