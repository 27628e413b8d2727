"""``varlen_attention_kv`` (the sequence mode's gathered-key attention) on its CUDA paths, driven on CPU through
recording fakes of flash-attn's varlen functions and torch's varlen ops that check the argument contract: separate
``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, on the tensors' device), their bounds as Python ints of at least 2 (never
the one-token shortcut of flash-attn #1537), causal as flash-attn's bottom-right alignment, torch's private forward
op called by parameter name (its arity differs between torch releases), ``enable_gqa`` only for grouped heads. The
fakes compute with compilepack's reference, so what is tested is the wiring: the kernel path's output and gradients
equal the reference path's exactly on a rank's slice (a document started on an earlier rank, one that starts
inside the slice, an empty one, two rows). Control: a fake that attends the slice's own keys only (the query
boundaries for the keys too, as the single-device path passes them) misses by far. The real kernels run in
tools/gpu_check."""

from __future__ import annotations

import types

import pytest
import torch

from compilepack.distributed import scan
from compilepack.ops import attention
from compilepack.ops.attention import reference
from compilepack.ops.attention import torch_varlen
from tests.ops.fakes import route_kernels
from tests.ops.fakes.torch_varlen import FLASH, RELEASES, cudnn_would_run, route_release
from tests.ops.properties import max_error
from tests.strategies import cu_seqlens_of


def _check_kv_contract(q, k, v, cu_q, cu_k, max_q, max_k):
    for x in (q, k, v):
        assert x.dim() == 3 and x.is_contiguous(), "varlen kernels want contiguous [T, heads, head_dim]"
    for cu, total in ((cu_q, q.shape[0]), (cu_k, k.shape[0])):
        assert cu.dtype == torch.int32 and cu.device == q.device and cu.shape == cu_q.shape
        assert int(cu[-1]) == total, "each boundary tensor ends at its own token count"
    assert type(max_q) is int and type(max_k) is int and min(max_q, max_k) >= 2, "bounds: Python ints >= 2"


class FakeFlashAttnKV(types.SimpleNamespace):
    """``flash_attn.flash_attn_interface`` for the kv path; ``slice_keys``: the key positions of the rank's own
    slice, for the control that attends those only, with the query boundaries for the keys too."""

    def __init__(self, slice_keys=None):
        super().__init__(calls=[], slice_keys=slice_keys)

    def _bounds(self, cu_q, cu_k):
        return cu_q, cu_q.as_subclass(torch.Tensor), *((cu_q, cu_q) if self.slice_keys is not None else (cu_k, cu_k))

    def _flash_attn_varlen_forward(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
        block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False,
    ):
        self.calls.append(("forward", cu_seqlens_q.tolist(), cu_seqlens_k.tolist()))
        _check_kv_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and type(softmax_scale) is float
        assert window_size_right == (0 if causal else window_size_left)
        if self.slice_keys is not None:
            k, v = k[self.slice_keys], v[self.slice_keys]
        out, (lse,) = reference.forward_kv(q, k, v, *self._bounds(cu_seqlens_q, cu_seqlens_k), max_seqlen_q,
                                           max_seqlen_k, causal, softmax_scale, window_size_left)
        return out, lse.float(), None, torch.zeros(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(
        self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
        rng_state=None, zero_tensors=False,
    ):
        self.calls.append(("backward", cu_seqlens_q.tolist(), cu_seqlens_k.tolist()))
        _check_kv_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[1], q.shape[0])
        grads = reference.backward_kv(dout, out, [softmax_lse], [True] * 3, q, k, v,
                                      *self._bounds(cu_seqlens_q, cu_seqlens_k), max_seqlen_q, max_seqlen_k, causal,
                                      softmax_scale, window_size_left)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(grad)


class FakeTorchAttnKV(types.SimpleNamespace):
    """``torch.ops.torch_attn`` for the kv path, registered with one release's schema (``route_release``)."""

    def __init__(self, release: str = "2.13.0"):
        super().__init__(calls=[], release=release)

    def _varlen_attn(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size,
                     enable_gqa=None, seqused_k=None, block_table=None, num_splits=None, backend=None):
        self.calls.append("forward")
        _check_kv_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        assert enable_gqa in (None, query.shape[1] != key.shape[1]), "enable_gqa only for grouped heads"
        assert backend in (None, FLASH), f"backend={backend}, not flash"
        assert not cudnn_would_run(query, key, max_q, window_size, enable_gqa), "torch 2.14 would run cuDNN here"
        causal, window_left = (True, -1) if is_causal else (window_size[1] == 0, window_size[0])
        assert not is_causal or window_size == [-1, 0]
        out, (lse,) = reference.forward_kv(query, key, value, cu_seq_q, cu_seq_q.as_subclass(torch.Tensor), cu_seq_k,
                                           cu_seq_k.as_subclass(torch.Tensor), max_q, max_k, causal, scale,
                                           window_left)
        return out, lse.float(), torch.zeros(2, dtype=torch.uint64)

    def _varlen_attn_backward(self, grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
                              is_causal, rng_state, scale=None, window_size=None, backend=None):
        self.calls.append("backward")
        assert backend in (None, FLASH)
        _check_kv_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        causal, window_left = (True, -1) if is_causal else (window_size[1] == 0, window_size[0])
        return tuple(reference.backward_kv(
            grad_out, out, [lse], [True] * 3, query, key, value, cu_seq_q, cu_seq_q.as_subclass(torch.Tensor),
            cu_seq_k, cu_seq_k.as_subclass(torch.Tensor), max_q, max_k, causal, scale, window_left))


def _rank_slice(lengths, rows, world, rank):
    """The sequence mode's boundaries on ``rank`` of ``world``: its queries' (its slice) and its keys' (every token
    of the rows up to its slice end), as ``ops/attention/sharded.py`` builds them."""
    cu, length = cu_seqlens_of(lengths), sum(lengths) // rows
    local = length // world
    cu_q = scan.local_cu_seqlens(cu, rows, length, rank * local, local)
    cu_k = scan.local_cu_seqlens(cu, rows, length, 0, (rank + 1) * local)
    return cu_q, cu_k, local, (rank + 1) * local


# rank 1 of 2 over rows of 16: row 0 = 5 | 9 | 2 (the 9 started on rank 0), row 1 = 16 (started on rank 0)
LAYOUT = ([5, 9, 2, 16], 2, 2, 1)
KV_KERNELS = {"flash_attn": ("flash_attn.flash_attn_interface", FakeFlashAttnKV),
              "torch_varlen": ("torch.nn.attention.varlen", FakeTorchAttnKV)}


def _run(backend, cu_q, cu_k, q, k, v, causal, window):
    out = attention.varlen_attention_kv(q, k, v, cu_q, cu_k, 8, 16, causal=causal, window=window,
                                        cu_seqlens_q_cpu=cu_q.clone(), cu_seqlens_k_cpu=cu_k.clone(),
                                        backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return [out.detach(), *grads]


def _inputs(cu_q, cu_k, heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(int(cu_q[-1]), heads, 16, generator=g)
    k, v = (torch.randn(int(cu_k[-1]), kv_heads, 16, generator=g) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


def _route(monkeypatch, backend, fake):
    module = KV_KERNELS[backend][0]
    if backend == "torch_varlen":
        route_kernels(monkeypatch, backend, {module: types.SimpleNamespace()})
        route_release(monkeypatch, fake, fake.release)
    else:
        route_kernels(monkeypatch, backend, {module: fake})


@pytest.mark.parametrize("backend", list(KV_KERNELS))
@pytest.mark.parametrize(("causal", "window", "kv_heads"), [(True, None, 2), (True, None, 1), (True, 5, 2),
                                                            (False, None, 2)])
def test_kv_kernel_path_equals_reference(monkeypatch, backend, causal, window, kv_heads):
    lengths, rows, world, rank = LAYOUT
    cu_q, cu_k, _, _ = _rank_slice(lengths, rows, world, rank)
    inputs = _inputs(cu_q, cu_k, 2, kv_heads)
    expected = _run("reference", cu_q, cu_k, *inputs, causal, window)
    fake = KV_KERNELS[backend][1]()
    _route(monkeypatch, backend, fake)
    got = _run(backend, cu_q, cu_k, *inputs, causal, window)
    assert len(fake.calls) == 2, fake.calls  # the forward and the backward both went to the library
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_kv_kernel_path_control_with_the_slice_keys_alone_misses(monkeypatch):
    lengths, rows, world, rank = LAYOUT
    cu_q, cu_k, local, end = _rank_slice(lengths, rows, world, rank)
    inputs = _inputs(cu_q, cu_k, 2, 2)
    expected = _run("reference", cu_q, cu_k, *inputs, True, None)
    slice_keys = torch.cat([torch.arange(row * end + end - local, row * end + end) for row in range(rows)])
    _route(monkeypatch, "flash_attn", FakeFlashAttnKV(slice_keys=slice_keys))
    q, k, v = (x.detach() for x in inputs)
    got = attention.varlen_attention_kv(q, k, v, cu_q, cu_k, 8, 16, backend="flash_attn")
    assert max_error(got, expected[0]) > 0.1


def test_kv_kernel_path_refuses_more_queries_than_keys(monkeypatch):
    """flash-attn #1778: with more queries than keys its causal kernels leave rows unwritten; refused on the host."""
    _route(monkeypatch, "flash_attn", FakeFlashAttnKV())
    cu_q, cu_k = torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([0, 3, 9], dtype=torch.int32)
    q, k, v = _inputs(cu_q, cu_k, 2, 2)
    with pytest.raises(ValueError, match="document 0 has more queries than keys"):
        attention.varlen_attention_kv(q, k, v, cu_q, cu_k, 4, 6, cu_seqlens_q_cpu=cu_q.clone(),
                                      cu_seqlens_k_cpu=cu_k.clone(), backend="flash_attn")


def _long_kv(monkeypatch, release):
    """Two key documents of 200 tokens whose last 150 are queries (the sequence mode's layout), equal heads: on
    torch 2.14 a causal call with a (-1, -1) window would run cuDNN (``max_q > 128``)."""
    cu_q, cu_k = torch.tensor([0, 150, 300], dtype=torch.int32), torch.tensor([0, 200, 400], dtype=torch.int32)
    q, k, v = _inputs(cu_q, cu_k, 2, 2)
    fake = FakeTorchAttnKV(release)
    _route(monkeypatch, "torch_varlen", fake)

    def run(backend):
        out = attention.varlen_attention_kv(q, k, v, cu_q, cu_k, 150, 200, cu_seqlens_q_cpu=cu_q.clone(),
                                            cu_seqlens_k_cpu=cu_k.clone(), backend=backend)
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))]

    return run, fake


@pytest.mark.parametrize("release", list(RELEASES))
def test_kv_path_binds_each_torch_release_and_stays_on_flash(monkeypatch, release):
    """Each release's op schema (2.11's 10 forward parameters, 2.15's ``backend``) binds compilepack's call, and
    the causal call never meets torch 2.14's cuDNN choice (top-left alignment: wrong for these queries)."""
    run, fake = _long_kv(monkeypatch, release)
    got, expected = run("torch_varlen"), run("reference")
    assert fake.calls == ["forward", "backward"]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_kv_path_control_a_causal_call_without_the_window_meets_cudnn_on_torch_2_14(monkeypatch):
    run, _ = _long_kv(monkeypatch, "2.14.1")
    monkeypatch.setattr(torch_varlen, "_window", lambda causal, left: (True, [-1, -1]) if causal else (False, [-1, -1]))
    with pytest.raises(Exception, match="torch 2.14 would run cuDNN"):
        run("torch_varlen")


def test_an_op_without_a_parameter_compilepack_needs_is_refused(monkeypatch):
    """A release whose op lost ``window_size`` (not one compilepack can leave out) fails with the fix named, never
    runs without the window."""
    run, _ = _long_kv(monkeypatch, "2.13.0")
    monkeypatch.setattr(torch_varlen, "_parameters", lambda op: frozenset({"query", "key", "is_causal", "scale"}))
    with pytest.raises(RuntimeError, match=r"takes no \['window_size'\].*backend=\{'attention': 'reference'\}"):
        run("torch_varlen")
