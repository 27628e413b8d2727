"""A stand-in for flash-linear-attention's chunk modules (fla-core 0.6.0): the functions compilepack's fla paths
call, with fla's argument names (a renamed or extra argument fails here with a TypeError), each call recorded.

Results come from compilepack's reference paths, so a path's wiring is tested, not fla's numerics (the Triton
interpreter tests run the real kernels)."""

from __future__ import annotations

import types

import torch

from compilepack.ops.gated_delta_rule import reference as gdr_reference
from compilepack.ops.kimi_delta_attention import reference as kda_reference

FLA_CHUNK = 64


class FakeFla(types.SimpleNamespace):
    """``fla.ops.gated_delta_rule.chunk`` or ``fla.ops.kda.chunk`` (and the helpers they import) for ``total``
    packed tokens."""

    def __init__(self, total: int):
        super().__init__(calls=[], total=total, host_boundaries=[])

    @staticmethod
    def packed_row(x, trailing: int):
        assert x.dim() == 2 + trailing and x.shape[0] == 1, f"fla varlen wants [1, T, ...], got {tuple(x.shape)}"
        assert x.is_contiguous(), "fla kernels index raw pointers: inputs must be contiguous"

    def l2norm_fwd(self, x):
        self.calls.append("l2norm_fwd")
        self.packed_row(x, 2)
        rstd = torch.rsqrt(x.float().square().sum(-1) + 1e-6)
        return (x * rstd[..., None]).to(x.dtype), rstd

    def l2norm_bwd(self, y, rstd, dy):
        self.calls.append("l2norm_bwd")
        assert rstd.dtype == torch.float32 and rstd.shape == y.shape[:-1]
        return rstd[..., None] * (dy - (dy * y).sum(-1, keepdim=True) * y)

    def prepare_chunk_indices(self, cu_seqlens, chunk_size, cu_seqlens_cpu=None):
        self.calls.append("prepare_chunk_indices")
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
        assert type(chunk_size) is int and chunk_size == FLA_CHUNK
        self.host_boundaries.append(cu_seqlens_cpu)
        return torch.zeros(3, 2, dtype=torch.int32)

    def check_inputs(self, q, k, v, scale, cu_seqlens, chunk_indices, initial_state, *per_head):
        for x in (q, k, v):
            self.packed_row(x, 2)
        for x in per_head:
            self.packed_row(x, x.dim() - 2)
        assert q.shape[1] == self.total and v.shape[2] % q.shape[2] == 0  # fla handles HV > H itself (GVA)
        assert type(scale) is float and initial_state is None
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device
        assert chunk_indices is not None, "pass chunk indices so fla does not rebuild them"

    def chunk_gated_delta_rule_fwd(
        self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None, chunk_indices=None
    ):
        self.calls.append("fwd")
        self.check_inputs(q, k, v, scale, cu_seqlens, chunk_indices, initial_state, g, beta)
        assert output_final_state is False
        o, _ = gdr_reference.PATH.forward(q, k, v, g, beta, cu_seqlens, None, False, scale)
        A = k.new_zeros(*v.shape[:3], FLA_CHUNK)
        g_cum = g.float() * 1.0  # stands for fla's chunk-local cumsum; the fake backward reads it back as g
        return g_cum, o.to(v.dtype), A, None, None, None

    def chunk_gated_delta_rule_bwd(
        self, q, k, v, g, beta, A, scale, initial_state, do, dht, cu_seqlens=None, chunk_indices=None
    ):
        self.calls.append("bwd")
        self.check_inputs(q, k, v, scale, cu_seqlens, chunk_indices, initial_state, g, beta)
        assert g.dtype == torch.float32 and A.shape == (*v.shape[:3], FLA_CHUNK) and dht is None
        o, saved = gdr_reference.PATH.forward(q, k, v, g, beta, cu_seqlens, None, False, scale)
        needs = [True] * 5
        dq, dk, dv, dg, db = gdr_reference.PATH.backward(
            do, o, saved, needs, q, k, v, g, beta, cu_seqlens, None, False, scale
        )
        return dq, dk, dv, db, dg, None, None, None

    def check_kda_inputs(self, q, k, v, g, beta, scale, cu_seqlens, chunk_indices, initial_state, chunk_size):
        self.check_inputs(q, k, v, scale, cu_seqlens, chunk_indices, initial_state, g, beta)
        assert g.shape == (*v.shape[:3], q.shape[-1]), "KDA's gate is per key channel: [1, T, HV, K]"
        assert q.shape[-1] <= 256, "fla's chunk_kda asserts K <= 256"
        assert type(chunk_size) is int and chunk_size == FLA_CHUNK

    def chunk_kda_fwd(
        self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None, chunk_indices=None,
        chunk_size=64,
    ):
        self.calls.append("fwd")
        self.check_kda_inputs(q, k, v, g, beta, scale, cu_seqlens, chunk_indices, initial_state, chunk_size)
        assert output_final_state is False
        o, _ = kda_reference.PATH.forward(q, k, v, g, beta, cu_seqlens, None, False, scale)
        A = k.new_zeros(*v.shape[:3], FLA_CHUNK)
        g_cum = g.float() * 1.0  # stands for fla's chunk-local cumsum; the fake backward reads it back as g
        return o.to(v.dtype), None, g_cum, A, A.clone(), None, None, None, None, None, None, None

    def chunk_kda_bwd(
        self, q, k, v, beta, Aqk, Akk, scale, initial_state, do, dht, g, cu_seqlens=None, chunk_indices=None,
        chunk_size=64,
    ):
        self.calls.append("bwd")
        self.check_kda_inputs(q, k, v, g, beta, scale, cu_seqlens, chunk_indices, initial_state, chunk_size)
        assert g.dtype == torch.float32 and dht is None
        assert Aqk.shape == Akk.shape == (*v.shape[:3], FLA_CHUNK)
        o, saved = kda_reference.PATH.forward(q, k, v, g, beta, cu_seqlens, None, False, scale)
        grads = kda_reference.PATH.backward(do, o, saved, [True] * 5, q, k, v, g, beta, cu_seqlens, None, False, scale)
        dq, dk, dv, dg, db = grads
        return dq, dk, dv, db, dg, None, None, None
