"""compilepack's kernel paths driven through the real fla and mamba-ssm kernels (Triton interpreter, CPU, fp32).

For the gated delta rule, Kimi delta attention and the Mamba2 chunk scan: the op with its CUDA backend forced onto
the real library vs the same op's reference, output and every input gradient, on layouts with 1-token documents,
documents of the library's chunk size +-1, many short documents, zero-length documents, two rows, and the layout
``PackedCollator(fixed_shape=True)`` emits (``packed-collator``: two rows of 83 tokens, T not a multiple of the
chunk size, a zero-length document in the middle and two at the end, 1-token documents, a padding-only document
whose tokens are all alike); and what the path's fake promises (outputs and saved tensors: shape, dtype, stride) vs
what the library returns. The Mamba2 scan takes ``seq_idx`` as the patch derives it from ``cu_seqlens``: a
zero-length document leaves a gap in the ids. Tolerance: 2e-5 of the largest reference entry (measured: ~2e-6;
fp32 throughout, the library and the reference sum in different orders).

These are the layouts of the varlen bugs reported against the libraries (docs/kernels.md): empty and padding-only
segments (fla #103, #892; VeOmni #845; LlamaFactory #10452), several rows (fla #955), a row length that leaves a
partial last chunk. None of them fails in the releases compilepack admits (fla 0.6.0, mamba-ssm 2.3.2.post1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compilepack.ops import backends
from compilepack.batch.derived import seq_idx_from_cu_seqlens
from compilepack.ops import gated_delta_rule, kimi_delta_attention, mamba2
from tests.ops.properties import assert_close
from tests.strategies import cu_seqlens_of

pytestmark = pytest.mark.kernels

TOL = 2e-5
FLA_CHUNK = 64
LAYOUTS = {
    "one-token-docs": ([1, 1, 5, 1], 1),
    "chunk-size-pm-1": ([FLA_CHUNK - 1, FLA_CHUNK + 1, FLA_CHUNK], 1),
    "many-short": ([3, 7, 2, 9, 1, 4, 6, 5, 8, 2, 3, 7], 1),
    "zero-length": ([20, 0, 30, 0], 1),
    "two-rows": ([40, 25, 65], 2),
    # row 0: 1, (empty), chunk + 1, 1, 16; row 1: 30, 1, 52 padding tokens, (empty), (empty)
    "packed-collator": ([1, 0, FLA_CHUNK + 1, 1, 16, 30, 1, 52, 0, 0], 2),
}
PADDING_DOCUMENT = {"packed-collator": 7}  # the layout's padding-only document (index into its lengths)


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


def _as_padding(tensors, lengths, layout):
    """The layout's padding-only document, if it has one, made of identical tokens (one pad token id embedded and
    projected the same way at every position): its first token's values repeated."""
    index = PADDING_DOCUMENT.get(layout)
    if index is None:
        return tensors
    start, end = sum(lengths[:index]), sum(lengths[: index + 1])
    for x in tensors:
        if x.shape[:2] == tensors[0].shape[:2]:  # per token (not a per-head parameter)
            flat = x.view(-1, *x.shape[2:])
            flat[start:end] = flat[start]
    return tensors


def _delta_rule_inputs(lengths, rows, per_channel, seed=0, layout=None):
    g = torch.Generator().manual_seed(seed)
    b, t = _rows(lengths, rows)
    q, k = (torch.randn(b, t, 2, 32, generator=g) for _ in range(2))
    k = k * 32**-0.5  # |k|^2 ~ 1: without the l2norm a run of alike keys (the padding document) would blow the state up
    v = torch.randn(b, t, 4, 32, generator=g)
    decay_shape = (b, t, 4, 32) if per_channel else (b, t, 4)
    decay = F.logsigmoid(torch.randn(*decay_shape, generator=g) + 2)
    beta = torch.rand(b, t, 4, generator=g)
    return [x.requires_grad_() for x in _as_padding([q, k, v, decay, beta], lengths, layout)]


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

    _assert_paths_agree(run, _delta_rule_inputs(lengths, rows, per_channel=False, layout=layout))
    assert "fla.ops.gated_delta_rule.chunk" in kernels_on_cpu


def test_gated_delta_rule_fla_saves_what_the_fake_says(kernels_on_cpu):
    lengths, rows = LAYOUTS["two-rows"]
    cu = cu_seqlens_of(lengths)
    inputs = [x.detach() for x in _delta_rule_inputs(lengths, rows, per_channel=False)]
    _assert_fake_matches(gated_delta_rule.OP, [*inputs, cu, cu.clone(), True, 32**-0.5, "fla"])


def test_kimi_delta_attention_fla_equals_reference(kernels_on_cpu):
    """One case, the layout that holds every other (1-token documents, chunk size + 1, empty documents in the middle
    and at the end, a padding-only document, two rows, a partial last chunk): KDA is slow under the interpreter."""
    layout = "packed-collator"
    lengths, rows = LAYOUTS[layout]
    cu = cu_seqlens_of(lengths)

    def run(q, k, v, g, beta, which):
        backend = "fla" if which == "kernel" else backends.REFERENCE
        return kimi_delta_attention.kimi_delta_attention_varlen(
            q, k, v, g, beta, cu, use_qk_l2norm=True, cu_seqlens_cpu=cu.clone(), backend=backend)

    inputs = _delta_rule_inputs(lengths, rows, per_channel=True, layout=layout)
    _assert_paths_agree(run, inputs)
    assert "fla.ops.kda.chunk" in kernels_on_cpu
    _assert_fake_matches(kimi_delta_attention.OP,
                         [*(x.detach() for x in inputs), cu, cu.clone(), True, 32**-0.5, "fla"])


# ------------------------------------------------------------------------------------------------ mamba-ssm


def _scan_inputs(lengths, rows, seed=0, layout=None):
    g = torch.Generator().manual_seed(seed)
    b, t = _rows(lengths, rows)
    x = torch.randn(b, t, 4, 16, generator=g)
    dt = torch.randn(b, t, 4, generator=g) * 0.5
    A = -torch.rand(4, generator=g) - 0.5
    B, C = (torch.randn(b, t, 2, 8, generator=g) for _ in range(2))
    D, dt_bias = torch.rand(4, generator=g), torch.rand(4, generator=g) * 0.1
    return [t.requires_grad_() for t in _as_padding([x, dt, A, B, C, D, dt_bias], lengths, layout)]


def _seq_idx(lengths, rows):
    """Document index per token, ``[rows, T / rows]``, as the patch derives it from ``cu_seqlens``: a zero-length
    document takes no token and leaves a gap in the ids (documents do not cross rows)."""
    return seq_idx_from_cu_seqlens(cu_seqlens_of(lengths), sum(lengths)).view(rows, -1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mamba2_chunk_scan_mamba_ssm_equals_reference(kernels_on_cpu, layout):
    lengths, rows = LAYOUTS[layout]
    seq_idx = _seq_idx(lengths, rows)

    def run(x, dt, A, B, C, D, dt_bias, which):
        backend = "mamba_ssm" if which == "kernel" else backends.REFERENCE
        return mamba2.mamba2_chunk_scan_varlen(x, dt, A, B, C, FLA_CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True,
                                              seq_idx=seq_idx, backend=backend)

    _assert_paths_agree(run, _scan_inputs(lengths, rows, layout=layout))
    assert "mamba_ssm.ops.triton.ssd_combined" in kernels_on_cpu


def test_mamba2_chunk_scan_mamba_ssm_returns_what_the_fake_says(kernels_on_cpu):
    lengths, rows = LAYOUTS["two-rows"]
    x, dt, A, B, C, D, dt_bias = (t.detach() for t in _scan_inputs(lengths, rows))
    seq_idx = _seq_idx(lengths, rows)
    inputs = [x, dt, A, B, C, seq_idx, D, dt_bias, FLA_CHUNK, True, 0.0, float("inf"), "mamba_ssm"]
    _assert_fake_matches(mamba2.OP, inputs)
