"""The sequence mode's state ops on the real fla kernels (Triton interpreter, CPU, fp32), against their references.

``gated_delta_rule_varlen_state`` / ``kimi_delta_attention_varlen_state`` with ``backend="fla"`` forced onto CPU
tensors vs the same op's reference path: the output, each row's final state, and the gradients of every input, the
initial state included. The layouts are what a rank's slice gives the state ops (``scan.local_cu_seqlens``: the
documents outside the slice become empty ones at its start and end): a first document that started on an earlier
rank (a nonzero initial state) and spans a chunk edge, 1-token documents, empty documents at the start, middle and
end of a row, a slice inside one document (first == last), two rows. Tolerance: 2e-5 of the largest reference entry.

Controls: the same kernel run with the initial states dropped (zero), or with the final state read from the row's
first document, misses by far.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compilepack.ops import backends
from compilepack.batch.derived import seq_idx_from_cu_seqlens
from compilepack.ops import gated_delta_rule, kimi_delta_attention, mamba2
from compilepack.ops._delta_rule import fla as _fla
from tests.ops.properties import assert_close, max_error
from tests.strategies import cu_seqlens_of

pytestmark = pytest.mark.kernels

TOL = 2e-5
FLA_CHUNK = 64
# (document lengths, rows): rows hold equal token counts, every row start is a document start
STATE_LAYOUTS = {
    # a slice's documents: empty ones before it, the first continued (70 tokens: past one chunk), a 1-token one,
    # an empty one, the last continuing on the next rank, empty ones after it
    "rank-edges": ([0, 0, 70, 1, 0, 57, 0], 1),
    "inside-one-document": ([0, 50, 0], 1),  # the whole slice is one document's middle: first == last
    "one-token-edges": ([1, 30, 1], 1),  # 1 token of the incoming document, 1 of the outgoing one
    # row 0: 10, 22; row 1: (empty), 1, 15, 16, (empty)
    "two-rows": ([10, 22, 0, 1, 15, 16, 0], 2),
}


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    loaded, load = [], backends.load
    monkeypatch.setattr(backends, "use_kernel", lambda tensor, backend: backend != backends.REFERENCE)
    monkeypatch.setattr(backends, "load", lambda name: loaded.append(name) or load(name))
    yield loaded


def _delta_rule_inputs(lengths, rows, per_channel, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = rows, sum(lengths) // rows
    q, k = (torch.randn(b, t, 2, 32, generator=g) for _ in range(2))
    v = torch.randn(b, t, 4, 16, generator=g)
    decay = F.logsigmoid(torch.randn(*((b, t, 4, 32) if per_channel else (b, t, 4)), generator=g) + 2)
    beta = torch.rand(b, t, 4, generator=g)
    initial = torch.randn(b, 4, 32, 16, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta, initial)]


def _run(state_op, inputs, cu, backend, drop_initial=False):
    """The op's output and final states, and every input's gradient under random output weights."""
    *tokens, initial = inputs
    o, final = state_op(*tokens, cu, initial * (0 if drop_initial else 1), use_qk_l2norm=True,
                        cu_seqlens_cpu=cu.clone(), backend=backend)
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(x.shape, generator=generator) for x in (o, final)]
    grads = torch.autograd.grad([o, final], inputs, weights)
    return [o.detach(), final.detach(), *grads]


def _print_worst(case, names, kernel, reference):
    """The figures (seen with ``pytest -s``): the worst error of the outputs and of the gradients, each relative to
    the largest reference entry (at least 1), as ``assert_close`` bounds it."""
    errors = {name: max_error(got, expected) for name, got, expected in zip(names, kernel, reference)}
    outputs = max(v for k, v in errors.items() if not k.startswith("grad"))
    grads = max(v for k, v in errors.items() if k.startswith("grad"))
    print(f"\n{case}: outputs {outputs:.1e}, gradients {grads:.1e} (worst: {max(errors, key=errors.get)})")


NAMES = ["output", "final state", "grad q", "grad k", "grad v", "grad g", "grad beta", "grad initial state"]
STATE_OPS = {
    "gated_delta_rule": (gated_delta_rule.gated_delta_rule_varlen_state, False, "fla.ops.gated_delta_rule.chunk"),
    "kimi_delta_attention": (kimi_delta_attention.kimi_delta_attention_varlen_state, True, "fla.ops.kda.chunk"),
}
# KDA is slow under the interpreter (~1-3 min a case on 2 busy cores): one layout, with 1-token and empty documents
# at both ends of a row and two rows; the glue around fla (``_delta_rule/fla.py``) is the gated delta rule's, which runs
# every layout and the controls
CASES = [("gated_delta_rule", layout) for layout in STATE_LAYOUTS] + [("kimi_delta_attention", "two-rows")]


@pytest.mark.parametrize(("op", "layout"), CASES)
def test_state_op_on_fla_equals_reference(kernels_on_cpu, op, layout):
    state_op, per_channel, module = STATE_OPS[op]
    lengths, rows = STATE_LAYOUTS[layout]
    cu, inputs = cu_seqlens_of(lengths), _delta_rule_inputs(lengths, rows, per_channel)
    kernel = _run(state_op, inputs, cu, "fla")
    reference = _run(state_op, inputs, cu, backends.REFERENCE)
    _print_worst(f"{op} {layout}", NAMES, kernel, reference)
    for name, got, expected in zip(NAMES, kernel, reference):
        assert_close(got, expected, f"{op} {layout}: {name}", TOL)
    assert module in kernels_on_cpu


@pytest.mark.parametrize("op", ["gated_delta_rule"])
def test_state_op_controls_miss(kernels_on_cpu, monkeypatch, op):
    """Controls on the kernel path: the initial states dropped (zero) miss the reference's output and initial-state
    gradient; the row's final state taken from its first document instead of its last misses the final state."""
    state_op, per_channel, _ = STATE_OPS[op]
    lengths, rows = STATE_LAYOUTS["rank-edges"]
    cu, inputs = cu_seqlens_of(lengths), _delta_rule_inputs(lengths, rows, per_channel)
    reference = _run(state_op, inputs, cu, backends.REFERENCE)
    dropped = _run(state_op, inputs, cu, "fla", drop_initial=True)
    assert max_error(dropped[0], reference[0]) > 1e-2, "output without the initial state"
    row_documents = _fla.row_documents
    monkeypatch.setattr(_fla, "row_documents", lambda *a: (row_documents(*a)[0],) * 2)  # last := first
    # a 1-token first document: the final state's gradient, sent to it, reaches its initial state undecayed
    lengths, rows = STATE_LAYOUTS["one-token-edges"]
    cu, inputs = cu_seqlens_of(lengths), _delta_rule_inputs(lengths, rows, per_channel)
    reference = _run(state_op, inputs, cu, backends.REFERENCE)
    wrong_document = _run(state_op, inputs, cu, "fla")
    assert max_error(wrong_document[1], reference[1]) > 1e-2, "final state of the first document"
    assert max_error(wrong_document[-1], reference[-1]) > 1e-2, "initial-state gradient with the wrong final state"


# ------------------------------------------------------------------------------------------------ mamba-ssm

MAMBA_CHUNK = 64


def _scan_inputs(lengths, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = rows, sum(lengths) // rows
    x = torch.randn(b, t, 4, 16, generator=g)
    dt = torch.randn(b, t, 4, generator=g) * 0.5 - 1  # softplus ~0.3: the first document's decay stays visible
    A = -torch.rand(4, generator=g) - 0.5
    B, C = (torch.randn(b, t, 2, 8, generator=g) for _ in range(2))
    D, dt_bias = torch.rand(4, generator=g), torch.rand(4, generator=g) * 0.1
    return [x.requires_grad_() for x in (x, dt, A, B, C, D, dt_bias)]


def _slice_seq_idx(lengths, rows, first_id=5):
    """Document ids of a rank's slice, ``[rows, T]``: global ids, so the first is not 0 (``first_id``), and a
    zero-length document leaves a gap."""
    return seq_idx_from_cu_seqlens(cu_seqlens_of(lengths), sum(lengths)).view(rows, -1) + first_id


def _run_scan(inputs, seq_idx, backend):
    x, dt, A, B, C, D, dt_bias = inputs
    outputs = mamba2.mamba2_chunk_scan_varlen_state(x, dt, A, B, C, MAMBA_CHUNK, D=D, dt_bias=dt_bias,
                                                    dt_softplus=True, seq_idx=seq_idx, backend=backend)
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=generator) for t in outputs]
    grads = torch.autograd.grad(outputs, inputs, weights)
    return [t.detach() for t in outputs] + list(grads)


SCAN_NAMES = ["y", "final state", "alpha", "grad x", "grad dt", "grad A", "grad B", "grad C", "grad D",
              "grad dt_bias"]


@pytest.mark.parametrize("layout", list(STATE_LAYOUTS))
def test_mamba2_state_op_on_mamba_ssm_equals_reference(kernels_on_cpu, layout):
    lengths, rows = STATE_LAYOUTS[layout]
    inputs, seq_idx = _scan_inputs(lengths, rows), _slice_seq_idx(lengths, rows)
    kernel = _run_scan(inputs, seq_idx, "mamba_ssm")
    reference = _run_scan(inputs, seq_idx, backends.REFERENCE)
    _print_worst(f"mamba2 {layout}", SCAN_NAMES, kernel, reference)
    for name, got, expected in zip(SCAN_NAMES, kernel, reference):
        assert_close(got, expected, f"mamba2 {layout}: {name}", TOL)
    assert "mamba_ssm.ops.triton.ssd_combined" in kernels_on_cpu


def test_mamba2_state_op_control_misses(kernels_on_cpu):
    """Control: the kernel path with the documents merged (one id for the whole slice) misses the reference's output
    and B's gradient (the final state and alpha barely: the first documents decay away by the slice's end)."""
    lengths, rows = STATE_LAYOUTS["rank-edges"]
    inputs, seq_idx = _scan_inputs(lengths, rows), _slice_seq_idx(lengths, rows)
    merged = _run_scan(inputs, torch.zeros_like(seq_idx), "mamba_ssm")
    reference = _run_scan(inputs, seq_idx, backends.REFERENCE)
    for name in ("y", "grad B"):
        i = SCAN_NAMES.index(name)
        assert max_error(merged[i], reference[i]) > 1e-2, name


def test_mamba_ssm_initial_states_reach_only_document_id_0(kernels_on_cpu):
    """Why the state op never hands mamba-ssm an initial state (``ops/mamba2/mamba_ssm.py``): in 2.3.2.post1 a row's
    initial state reaches its first document only when that document's id is 0; with the ids a rank's slice has
    (the first one 5) it is silently dropped."""
    ssd = backends.load("mamba_ssm.ops.triton.ssd_combined")
    lengths, rows = STATE_LAYOUTS["rank-edges"]
    x, dt, A, B, C, _, _ = (t.detach() for t in _scan_inputs(lengths, rows))
    h0 = torch.randn(rows, 4, 16, 8, generator=torch.Generator().manual_seed(2))
    ids = _slice_seq_idx(lengths, rows)
    ids = ids - ids[:, :1]  # the first document's id 0

    def scan(seq_idx, initial):
        return ssd.mamba_chunk_scan_combined(x, dt, A, B, C, MAMBA_CHUNK, initial_states=initial,
                                             seq_idx=seq_idx.to(torch.int32), dt_softplus=True)

    assert max_error(scan(ids, h0), scan(ids, None)) > 1e-2  # id 0: the initial state is read
    torch.testing.assert_close(scan(ids + 5, h0), scan(ids + 5, None), rtol=0, atol=0)  # id 5: ignored


def _assert_fake_matches(op, inputs):
    """The kernel path's fake (what the compiler plans with) describes what the library's path returned."""
    path = op.path_of(*inputs)
    *real_outs, real_saved = path.forward(*inputs[:-1])
    *fake_outs, fake_saved = path.fake(*inputs[:-1])
    assert len(real_outs) == len(fake_outs) and len(real_saved) == len(fake_saved)
    for real, fake in zip([*real_outs, *real_saved], [*fake_outs, *fake_saved]):
        assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride())


def test_state_paths_return_what_their_fakes_say(kernels_on_cpu):
    lengths, rows = STATE_LAYOUTS["one-token-edges"]
    cu = cu_seqlens_of(lengths)
    q, k, v, g, beta, initial = (x.detach() for x in _delta_rule_inputs(lengths, rows, per_channel=False))
    _assert_fake_matches(gated_delta_rule.OP_STATE, [q, k, v, g, beta, cu, cu.clone(), initial, True, 32**-0.5, "fla"])
    x, dt, A, B, C, D, dt_bias = (t.detach() for t in _scan_inputs(lengths, rows))
    seq_idx = _slice_seq_idx(lengths, rows).to(torch.int32)
    _assert_fake_matches(mamba2.OP_STATE, [x, dt, A, B, C, seq_idx, D, dt_bias, MAMBA_CHUNK, True, 0.0, float("inf"),
                                           "mamba_ssm"])
