"""compilepack::kimi_delta_attention_varlen: exact on packed rows, equal to transformers on one document, explicit
backward checked against an fp64 token-by-token recurrence, one graph under torch.compile, and the fla path
driven on CPU through a fake fla module that checks the argument contract.

Tolerances: the op computes in fp32 (as transformers does). Outputs and gradients are compared with an absolute
bound of 1e-5 scaled by the largest magnitude of the reference tensor (at least 1): the chunked algorithm sums
O(K * chunk) fp32 products per entry, so the error grows with the entry size, not with the token count
(measured: <= 4e-7 of the largest entry against fp64, for outputs and every gradient).

The packed-vs-alone property test compares the op on the packed row with the op on every document alone:
transformers' torch fallback costs seconds per call here (a Python loop over chunk rows, under autograd), so it
is the ground truth only in the single-document tests, and the fp64 recurrence in the packed gradient tests.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from transformers.models.kimi_linear import modeling_kimi_linear

from compilepack import backends
from compilepack.ops import kimi_delta_attention as kda
from compilepack.ops.kimi_delta_attention import kimi_delta_attention_varlen
from tests.compiling import graphs_compiled
from tests.strategies import cu_seqlens_of, doc_lengths

STOCK = inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)  # the torch fallback (no kernel lookup)
H, HV, K, V = 2, 4, 16, 8  # grouped value heads (HV = 2 H), fla's layout; Kimi Linear itself has HV == H
FP32_TOL = 1e-5
NAMES = "q k v g beta".split()


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


def run_op(inputs, cu_seqlens, grad_seed: int = 1, **kwargs):
    o = kimi_delta_attention_varlen(*inputs, cu_seqlens, **kwargs)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=o.dtype)
    return o.detach(), list(torch.autograd.grad(o, inputs, do)), do


def run_stock(inputs, do=None):
    q, k, v, g, beta = inputs
    o = STOCK(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    return o.detach(), (None if do is None else list(torch.autograd.grad(o, inputs, do)))


def assert_close(actual, expected, what: str, tol: float = FP32_TOL):
    bound = tol * max(1.0, expected.abs().max().item())
    err = (actual - expected).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def op_on_each_document_alone(inputs, lengths, do, **kwargs):
    """The op on every document alone, each in its own row of a right-padded batch (one row = one document).

    The rule is causal, so padding after a document changes none of its outputs, and the padded outputs get a
    zero gradient, so they add nothing to the gradients either. Every document starts a row (and a chunk) here,
    wherever it starts in the packed row.
    """
    lengths = [n for n in lengths if n > 0]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    pieces = [[x[0, s : s + n] for s, n in zip(starts, lengths)] for x in (*inputs, do)]
    batch = [torch.nn.utils.rnn.pad_sequence(p, batch_first=True).detach().requires_grad_() for p in pieces]
    rows, row_length = batch[0].shape[:2]
    cu_seqlens = torch.arange(rows + 1, dtype=torch.int32) * row_length
    o = kimi_delta_attention_varlen(*batch[:5], cu_seqlens, **kwargs)
    grads = torch.autograd.grad(o, batch[:5], batch[5])
    unpad = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]  # noqa: E731
    return unpad(o.detach()), [unpad(g) for g in grads]


def naive_recurrence_fp64(q, k, v, g, beta, lengths, scale, l2norm=True):
    """Token-by-token KDA in fp64, state zeroed per document: the independent exact answer."""
    if l2norm:
        q, k = F.normalize(q, dim=-1, eps=0), F.normalize(k, dim=-1, eps=0)
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, 2) * scale, k.repeat_interleave(group, 2)
    outs, start = [], 0
    for length in lengths:
        state = q.new_zeros(v.shape[2], q.shape[-1], v.shape[-1])
        for t in range(start, start + length):
            state = state * g[0, t].exp()[:, :, None]  # per key channel
            delta = v[0, t] - torch.einsum("hkv,hk->hv", state, k[0, t])
            state = state + torch.einsum("hk,hv->hkv", k[0, t], delta * beta[0, t][:, None])
            outs.append(torch.einsum("hkv,hk->hv", state, q[0, t]))
        start += length
    return torch.stack(outs)[None]


def check_against_fp64(inputs, lengths, scale=None, **kwargs):
    o, grads, do = run_op(inputs, cu_seqlens_of(lengths), scale=scale, **kwargs)
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    scale = inputs[0].shape[-1] ** -0.5 if scale is None else scale
    o64 = naive_recurrence_fp64(*inputs64, lengths, scale, l2norm=kwargs.get("use_qk_l2norm_in_kernel", False))
    grads64 = torch.autograd.grad(o64, inputs64, do.double())
    assert_close(o.double(), o64, "output")
    for name, got, ref in zip(NAMES, grads, grads64):
        assert_close(got.double(), ref, f"d{name}")


# --------------------------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------------------------


@given(lengths=doc_lengths())
def test_packed_equals_each_document_alone(lengths):
    inputs = make_inputs(sum(lengths), seed=len(lengths))
    o, grads, do = run_op(inputs, cu_seqlens_of(lengths), use_qk_l2norm_in_kernel=True)
    o_ref, grads_ref = op_on_each_document_alone(inputs, lengths, do, use_qk_l2norm_in_kernel=True)
    assert_close(o, o_ref, "output")
    for name, got, ref in zip(NAMES, grads, grads_ref):
        assert_close(got, ref, f"d{name}")


@pytest.mark.parametrize("heads", [(H, HV), (2, 2)], ids=["grouped-values", "kimi-heads"])
def test_packed_gradients_match_fp64_recurrence(heads):
    """The hand-derived backward against autograd through an fp64 token loop, on a packed row whose documents
    start inside chunks, on chunk edges and span several chunks."""
    check_against_fp64(make_inputs(136, seed=3, heads=heads), [5, 19, 1, 8, 63, 40], use_qk_l2norm_in_kernel=True)


def test_without_l2norm_and_custom_scale():
    inputs = make_inputs(70, seed=5)
    q, k = (F.normalize(x.detach(), dim=-1).requires_grad_() for x in inputs[:2])
    check_against_fp64([q, k, *inputs[2:]], [40, 30], scale=0.3)
    check_against_fp64([q, k, *inputs[2:]], [40, 30])  # default scale K ** -0.5


def test_fast_decays_stay_exact():
    """Decays of ~-60 per token: exp(+-sum of g) over a chunk overflows fp32, so any factorisation of the pair
    decay into exp(G_i) exp(-G_j) would give inf/nan; the elementwise pair decay stays exact."""
    inputs = make_inputs(40, seed=7, decay=60.0)
    chunk_decay = inputs[3].detach()[0, : kda.CHUNK].sum(0)
    assert (chunk_decay < -100).float().mean() > 0.9  # exp(100) > fp32 max: a factorised product would overflow
    check_against_fp64(inputs, [25, 15], use_qk_l2norm_in_kernel=True)


def test_single_document_equals_stock_function():
    inputs = make_inputs(80, heads=(2, 2))  # transformers' fallback has no grouped values; 80 > its 64 chunk
    o, grads, do = run_op(inputs, cu_seqlens_of([80]), use_qk_l2norm_in_kernel=True)
    o_ref, grads_ref = run_stock(inputs, do)
    assert_close(o, o_ref, "output")
    for name, got, ref in zip(NAMES, grads, grads_ref):
        assert_close(got, ref, f"d{name}")


def test_stock_function_leaks_across_documents():
    """What the op fixes: the stock function on a packed row mixes the second document with the first."""
    lengths = [50, 30]
    inputs = [x.detach() for x in make_inputs(sum(lengths), heads=(2, 2))]
    with torch.no_grad():
        o_stock_packed, _ = run_stock(inputs)
        o_stock_second, _ = run_stock([x[:, 50:] for x in inputs])
        o_op = kimi_delta_attention_varlen(*inputs, cu_seqlens_of(lengths), use_qk_l2norm_in_kernel=True)
    leak = (o_stock_packed[:, 50:] - o_stock_second).abs().max().item()
    assert leak > 1e-2, f"stock function should leak on a packed row, max difference only {leak:.3g}"
    assert_close(o_op[:, :50], o_stock_packed[:, :50], "first document")
    assert_close(o_op[:, 50:], o_stock_second, "second document")


def test_batch_rows_are_documents():
    """B > 1: each row edge is a document edge, so B rows equal one packed row of B documents."""
    inputs = make_inputs(30, batch=3)
    o, grads, do = run_op(inputs, cu_seqlens_of([30, 30, 30]), use_qk_l2norm_in_kernel=True)
    flat = [x.detach().reshape(1, 90, *x.shape[2:]).requires_grad_() for x in inputs]
    o_ref, grads_ref, _ = run_op(flat, cu_seqlens_of([30, 30, 30]), use_qk_l2norm_in_kernel=True)
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


def test_chunk_loops_run_on_one_thread_when_small_and_restore_the_thread_count(monkeypatch):
    seen = []
    loop = kda._chunk_start_states
    monkeypatch.setattr(kda, "_chunk_start_states", lambda *a: (seen.append(torch.get_num_threads()), loop(*a))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_op(make_inputs(40), cu_seqlens_of([15, 25]))
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(kda, "SERIAL_LOOP_MAX_WORK", 1)  # every loop "large": threads untouched
        run_op(make_inputs(40), cu_seqlens_of([15, 25]))
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_bfloat16_inputs_keep_their_dtype():
    inputs = make_inputs(40, dtype=torch.bfloat16)
    o, grads, _ = run_op(inputs, cu_seqlens_of([15, 25]), use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 40, HV, V)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 5


# --------------------------------------------------------------------------------------------------------------
# Op contract: opcheck, compile
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[8], [1, 7, 8, 2, 20], [10, 0, 30]])
def test_opcheck(lengths):
    inputs = make_inputs(sum(lengths), seed=2)
    cu = cu_seqlens_of(lengths) if 0 not in lengths else torch.tensor([0, 10, 10, 40], dtype=torch.int32)
    args = (*inputs, cu, True, K**-0.5, backends.REFERENCE)
    torch.library.opcheck(kda._kda_op, args)
    o, saved = kda._kda_op(*args)
    # the backward op has no double backward: check it on plain tensors
    plain = [x.detach() for x in (torch.randn_like(o), *inputs)]
    torch.library.opcheck(kda._kda_backward_op, (*plain, cu, saved, True, K**-0.5, backends.REFERENCE))


def loss_of(q, k, v, g, beta, cu_seqlens):
    return kimi_delta_attention_varlen(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel=True).square().sum()


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
            loss = compiled(*make_inputs(sum(lengths), seed=i), cu_seqlens_of(lengths))
            loss.backward()
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


class FakeFla(types.SimpleNamespace):
    """Stands in for ``fla.ops.kda.chunk`` (fla-core 0.6.0, arguments shared with 0.5.0); records every call."""

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

    def _check(self, q, k, v, g, beta, scale, cu_seqlens, chunk_indices, chunk_size, initial_state):
        for x in (q, k, v, g):
            self._packed_row(x, 0, 0)
        self._packed_row(beta, 0)
        assert q.shape[1] == self.total and v.shape[2] % q.shape[2] == 0  # fla handles HV > H itself (GVA)
        assert g.shape == (*v.shape[:3], q.shape[-1]), "KDA's gate is per key channel: [1, T, HV, K]"
        assert type(scale) is float and initial_state is None
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device
        assert chunk_indices is not None, "pass chunk indices so fla does not rebuild them"
        assert type(chunk_size) is int and chunk_size == 64

    # only the arguments fla-core 0.5.0 and 0.6.0 share: passing any other one fails here with a TypeError
    def chunk_kda_fwd(
        self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices, chunk_size
    ):
        self.calls.append("fwd")
        self._check(q, k, v, g, beta, scale, cu_seqlens, chunk_indices, chunk_size, initial_state)
        assert output_final_state is False
        o, _ = kda._reference_forward(q, k, v, g, beta, cu_seqlens, False, scale)
        A = k.new_zeros(*v.shape[:3], 64)
        g_cum = g.float() * 1.0  # stands for fla's chunk-local cumsum; the fake backward reads it back as g
        return o.to(v.dtype), None, g_cum, A, A.clone(), None, None, None, None, None, None, None

    def chunk_kda_bwd(
        self, q, k, v, beta, Aqk, Akk, scale, initial_state, do, dht, g, cu_seqlens, chunk_indices, chunk_size
    ):
        self.calls.append("bwd")
        self._check(q, k, v, g, beta, scale, cu_seqlens, chunk_indices, chunk_size, initial_state)
        assert g.dtype == torch.float32 and dht is None
        assert Aqk.shape == Akk.shape == (*v.shape[:3], 64)
        _, saved = kda._reference_forward(q, k, v, g, beta, cu_seqlens, False, scale)
        dq, dk, dv, dg, db = kda._reference_backward(do, q, k, v, g, beta, cu_seqlens, saved, False, scale)
        return dq, dk, dv, db, dg, None, None, None


@pytest.fixture
def fake_fla(monkeypatch):
    fakes = {}

    def load(name):
        assert name == "fla.ops.kda.chunk"
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
    o, grads, do = run_op(inputs, cu, use_qk_l2norm_in_kernel=use_qk_l2norm, backend="fla")
    forward = ["l2norm_fwd"] * 2 * use_qk_l2norm + ["prepare_chunk_indices", "fwd"]
    assert fake.calls == forward + ["prepare_chunk_indices", "bwd"] + ["l2norm_bwd"] * 2 * use_qk_l2norm
    o_ref, grads_ref, _ = run_op(inputs, cu, use_qk_l2norm_in_kernel=use_qk_l2norm, backend="reference")
    assert_close(o, o_ref, "output")
    for name, got, ref in zip(NAMES, grads, grads_ref):
        assert_close(got, ref, f"d{name}")


def test_fla_path_flattens_batch_rows_and_passes_opcheck(fake_fla):
    inputs = make_inputs(70, batch=2, seed=6)
    cu = cu_seqlens_of([70, 70])
    fake_fla["fla"] = FakeFla(140)
    args = (*inputs, cu, True, K**-0.5, "fla")
    torch.library.opcheck(kda._kda_op, args)  # the fake's saved shapes match fla's
    o, saved = kda._kda_op(*args)
    assert [tuple(s.shape) for s in saved] == [
        (2, 70, H, K), (2, 70, H), (2, 70, H, K), (2, 70, H), (2, 70, HV, K), (2, 70, HV, 64), (2, 70, HV, 64)
    ]
    plain = [x.detach() for x in (torch.randn_like(o), *inputs)]
    torch.library.opcheck(kda._kda_backward_op, (*plain, cu, saved, True, K**-0.5, "fla"))


def test_fla_path_runs_the_reference_for_key_heads_over_256(fake_fla):
    """fla's chunk_kda asserts K <= 256: larger key heads run the reference, also on CUDA."""
    inputs = make_inputs(12, seed=8, dims=(320, 8))
    fake_fla["fla"] = fake = FakeFla(12)
    o, grads, _ = run_op(inputs, cu_seqlens_of([5, 7]), use_qk_l2norm_in_kernel=True, backend="fla")
    o_ref, grads_ref, _ = run_op(inputs, cu_seqlens_of([5, 7]), use_qk_l2norm_in_kernel=True)
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
        (lambda a: a.update(g=a["g"][..., 0]), "g must be 4-D"),
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
