"""compilepack's kernel paths driven through the real fla and mamba-ssm kernels (Triton interpreter, CPU, fp32).

For the gated delta rule, Kimi delta attention and the Mamba2 chunk scan: the op with its CUDA backend forced onto
the real library vs the same op's reference, output and every input gradient, on layouts with 1-token documents,
documents of the library's chunk size +-1, many short documents, zero-length documents where the op takes them,
and two rows; and what the path's fake promises (outputs and saved tensors: shape, dtype, stride) vs what the
library returns. Tolerance: 2e-5 of the largest reference entry (measured: ~2e-6; fp32 throughout, the library
and the reference sum in different orders).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compilepack import backends
from compilepack.ops import gated_delta_rule, kimi_delta_attention, mamba2
from tests.ops.properties import assert_close
from tests.strategies import cu_seqlens_of, seq_idx_of

pytestmark = pytest.mark.kernels

TOL = 2e-5
FLA_CHUNK = 64
LAYOUTS = {
    "one-token-docs": ([1, 1, 5, 1], 1),
    "chunk-size-pm-1": ([FLA_CHUNK - 1, FLA_CHUNK + 1, FLA_CHUNK], 1),
    "many-short": ([3, 7, 2, 9, 1, 4, 6, 5, 8, 2, 3, 7], 1),
    "zero-length": ([20, 0, 30, 0], 1),
    "two-rows": ([40, 25, 65], 2),
}


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Every op takes its kernel path for the backend it is given, on CPU tensors; yields the kernel modules
    loaded, to prove the library ran."""
    loaded, load = [], backends.load
    monkeypatch.setattr(backends, "use_kernel", lambda tensor, backend: backend != backends.REFERENCE)
    monkeypatch.setattr(backends, "load", lambda name: loaded.append(name) or load(name))
    yield loaded


def _rows(lengths, rows):
    total = sum(lengths)
    assert total % rows == 0
    return rows, total // rows


def _delta_rule_inputs(lengths, rows, per_channel, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = _rows(lengths, rows)
    q, k = (torch.randn(b, t, 2, 32, generator=g) for _ in range(2))
    v = torch.randn(b, t, 4, 32, generator=g)
    decay_shape = (b, t, 4, 32) if per_channel else (b, t, 4)
    decay = F.logsigmoid(torch.randn(*decay_shape, generator=g) + 2)
    beta = torch.rand(b, t, 4, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def _run(function, inputs, seed=1):
    out = function(*inputs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return out.detach(), grads


def _assert_paths_agree(function, inputs):
    out_kernel, grads_kernel = _run(lambda *x: function(*x, "kernel"), inputs)
    out_ref, grads_ref = _run(lambda *x: function(*x, "reference"), inputs)
    assert_close(out_kernel, out_ref, "output", TOL)
    for i, (got, ref) in enumerate(zip(grads_kernel, grads_ref)):
        if ref is not None:
            assert got is not None, f"input {i}: no gradient on the kernel path"
            assert_close(got, ref, f"grad of input {i}", TOL)


def _assert_fake_matches(op, inputs):
    """The kernel path's fake (what the compiler plans with) describes what the library returned."""
    path = op.path_of(*inputs)
    real_out, real_saved = path.forward(*inputs[:-1])
    fake_out, fake_saved = path.fake(*inputs[:-1])
    assert len(real_saved) == len(fake_saved)
    for real, fake in zip([real_out, *real_saved], [fake_out, *fake_saved]):
        assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride())


# ------------------------------------------------------------------------------------------------ fla


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_gated_delta_rule_fla_equals_reference(kernels_on_cpu, layout, use_qk_l2norm):
    lengths, rows = LAYOUTS[layout]
    cu = cu_seqlens_of(lengths)

    def run(q, k, v, g, beta, which):
        backend = "fla" if which == "kernel" else backends.REFERENCE
        return gated_delta_rule.gated_delta_rule_varlen(
            q, k, v, g, beta, cu, use_qk_l2norm=use_qk_l2norm, cu_seqlens_cpu=cu.clone(), backend=backend)

    _assert_paths_agree(run, _delta_rule_inputs(lengths, rows, per_channel=False))
    assert "fla.ops.gated_delta_rule.chunk" in kernels_on_cpu


def test_gated_delta_rule_fla_saves_what_the_fake_says(kernels_on_cpu):
    lengths, rows = LAYOUTS["two-rows"]
    cu = cu_seqlens_of(lengths)
    inputs = [x.detach() for x in _delta_rule_inputs(lengths, rows, per_channel=False)]
    _assert_fake_matches(gated_delta_rule.OP, [*inputs, cu, cu.clone(), True, 32**-0.5, "fla"])


def test_kimi_delta_attention_fla_equals_reference(kernels_on_cpu):
    """One case: KDA is slow under the interpreter."""
    lengths, rows = [1, FLA_CHUNK + 1, 14], 1
    cu = cu_seqlens_of(lengths)

    def run(q, k, v, g, beta, which):
        backend = "fla" if which == "kernel" else backends.REFERENCE
        return kimi_delta_attention.kimi_delta_attention_varlen(
            q, k, v, g, beta, cu, use_qk_l2norm=True, cu_seqlens_cpu=cu.clone(), backend=backend)

    inputs = _delta_rule_inputs(lengths, rows, per_channel=True)
    _assert_paths_agree(run, inputs)
    assert "fla.ops.kda.chunk" in kernels_on_cpu
    _assert_fake_matches(kimi_delta_attention.OP, [*(x.detach() for x in inputs), cu, cu.clone(), True, 32**-0.5, "fla"])


# ------------------------------------------------------------------------------------------------ mamba-ssm


def _scan_inputs(lengths, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = _rows(lengths, rows)
    x = torch.randn(b, t, 4, 16, generator=g)
    dt = torch.randn(b, t, 4, generator=g) * 0.5
    A = -torch.rand(4, generator=g) - 0.5
    B, C = (torch.randn(b, t, 2, 8, generator=g) for _ in range(2))
    D, dt_bias = torch.rand(4, generator=g), torch.rand(4, generator=g) * 0.1
    return [t.requires_grad_() for t in (x, dt, A, B, C, D, dt_bias)]


def _seq_idx(lengths, rows):
    """Document index per token, ``[rows, T / rows]`` (documents do not cross rows)."""
    return seq_idx_of([n for n in lengths if n]).view(rows, -1)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "zero-length"])  # seq_idx has no empty docs
def test_mamba2_chunk_scan_mamba_ssm_equals_reference(kernels_on_cpu, layout):
    lengths, rows = LAYOUTS[layout]
    seq_idx = _seq_idx(lengths, rows)

    def run(x, dt, A, B, C, D, dt_bias, which):
        backend = "mamba_ssm" if which == "kernel" else backends.REFERENCE
        return mamba2.mamba2_chunk_scan_varlen(x, dt, A, B, C, FLA_CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True,
                                              seq_idx=seq_idx, backend=backend)

    _assert_paths_agree(run, _scan_inputs(lengths, rows))
    assert "mamba_ssm.ops.triton.ssd_combined" in kernels_on_cpu


def test_mamba2_chunk_scan_mamba_ssm_returns_what_the_fake_says(kernels_on_cpu):
    lengths, rows = LAYOUTS["two-rows"]
    x, dt, A, B, C, D, dt_bias = (t.detach() for t in _scan_inputs(lengths, rows))
    seq_idx = _seq_idx(lengths, rows)
    inputs = [x, dt, A, B, C, seq_idx, D, dt_bias, FLA_CHUNK, True, 0.0, float("inf"), "mamba_ssm"]
    _assert_fake_matches(mamba2.OP, inputs)
