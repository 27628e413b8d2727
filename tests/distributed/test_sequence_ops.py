"""The ops context parallelism over tokens adds, on one process: the delta rules' and the Mamba2 scan's state variants
and attention with separate query and key boundaries. A row cut in two, its second part given the first part's
state, equals the row in one piece (fp64); fp64 gradcheck covers every input and output (the initial and final
states included); opcheck checks the registrations. And the state pass's schedule choice."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from compilepack.distributed.scan import chosen_schedule, schedule_elements
from compilepack.ops import attention, gated_delta_rule, kimi_delta_attention, mamba2

F64 = torch.float64
SPLIT_TOLERANCE = 1e-10  # fp64: the two-part run and the one-piece run differ by rounding only


def _delta_inputs(total: int, per_channel: bool, rows: int = 1, heads: int = 2, value_heads: int = 4, key_dim: int = 8,
                  value_dim: int = 6, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, rows, total, heads, key_dim, generator=generator, dtype=F64).unbind(0)
    v = torch.randn(rows, total, value_heads, value_dim, generator=generator, dtype=F64)
    decay = (value_heads, key_dim) if per_channel else (value_heads,)
    g = -torch.rand(rows, total, *decay, generator=generator, dtype=F64) / 4
    beta = torch.rand(rows, total, value_heads, generator=generator, dtype=F64)
    return [q, k, v, g, beta]


DELTA_RULES = {
    "gated_delta_rule": (gated_delta_rule.gated_delta_rule_varlen, gated_delta_rule.gated_delta_rule_varlen_state,
                         gated_delta_rule.OP_STATE, False),
    "kimi_delta_attention": (kimi_delta_attention.kimi_delta_attention_varlen,
                             kimi_delta_attention.kimi_delta_attention_varlen_state, kimi_delta_attention.OP_STATE,
                             True),
}


def _cu(*bounds: int) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int32)


@pytest.mark.parametrize("rule", list(DELTA_RULES))
def test_delta_rule_state_passed_across_a_cut_equals_the_row(rule):
    """113 tokens, four documents; cut at 70 (inside the third): the second part, started from the first part's
    final state, equals the row run in one piece, and so does the first part."""
    varlen, state_op, _, per_channel = DELTA_RULES[rule]
    x = _delta_inputs(113, per_channel)
    full = varlen(*x, _cu(0, 50, 53, 93, 113))
    zero = torch.zeros(1, 4, 8, 6, dtype=F64)
    first, state = state_op(*(t[:, :70] for t in x), _cu(0, 50, 53, 70), zero)
    second, _ = state_op(*(t[:, 70:] for t in x), _cu(0, 23, 43), state)
    assert (first - full[:, :70]).abs().max() <= SPLIT_TOLERANCE
    assert (second - full[:, 70:]).abs().max() <= SPLIT_TOLERANCE
    # control: the second part from a zero state misses
    cut, _ = state_op(*(t[:, 70:] for t in x), _cu(0, 23, 43), zero)
    assert (cut - full[:, 70:]).abs().max() > 1e-2


@pytest.mark.parametrize("rule", list(DELTA_RULES))
def test_delta_rule_state_rows_are_independent(rule):
    """Two rows of 56 tokens in one call equal each row alone: each row's first document reads its own initial
    state, each row's final state is its own."""
    _, state_op, _, per_channel = DELTA_RULES[rule]
    x = [t.reshape(2, 56, *t.shape[2:]) for t in _delta_inputs(112, per_channel)]
    initial = torch.randn(2, 4, 8, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    both, finals = state_op(*x, _cu(0, 30, 56, 70, 112), initial)
    for row, cu in ((0, _cu(0, 30, 56)), (1, _cu(0, 14, 56))):
        alone, final = state_op(*(t[row : row + 1] for t in x), cu, initial[row : row + 1])
        assert torch.equal(alone, both[row : row + 1]) and torch.equal(final, finals[row : row + 1])


@pytest.mark.parametrize("rule", list(DELTA_RULES))
def test_delta_rule_state_fp64_gradcheck_and_opcheck(rule):
    """Every input (q, k, v, g, beta, the initial state) and both outputs (o, the final state); two rows, a row
    that is one document (its final state depends on its initial one) and a row of three."""
    _, state_op, op, per_channel = DELTA_RULES[rule]
    x = [t.requires_grad_() for t in _delta_inputs(20, per_channel, rows=2, heads=1, value_heads=2, key_dim=4,
                                                       value_dim=3)]
    initial = torch.randn(2, 2, 4, 3, dtype=F64, requires_grad=True)
    cu = _cu(0, 20, 23, 33, 40)
    assert torch.autograd.gradcheck(lambda *t: state_op(*t[:5], cu, t[5]), (*x, initial))
    inputs = [t.detach().float().requires_grad_() for t in x]
    opcheck(op.forward, (*inputs, cu, None, initial.detach().float().requires_grad_(), True, 0.5, "reference"))


def _scan_inputs(total: int, rows: int = 1, heads: int = 4, head_dim: int = 3, groups: int = 2, state: int = 5):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=F64)

    return [rand(rows, total, heads, head_dim), rand(rows, total, heads), -torch.rand(heads, generator=generator,
            dtype=F64), rand(rows, total, groups, state), rand(rows, total, groups, state), rand(heads), rand(heads)]


def test_mamba2_state_passed_across_a_cut_equals_the_row():
    """70 tokens, four documents, cut at 40 (inside the third): the second part's ``y`` plus its first document's
    decays times the first part's final state read by C equals the row in one piece."""
    x, dt, A, B, C, D, bias = _scan_inputs(70)
    seq_idx = torch.repeat_interleave(torch.arange(4), torch.tensor([20, 3, 40, 7]))[None].to(torch.int32)
    options = dict(D=D, dt_bias=bias, dt_softplus=True)
    full = mamba2.mamba2_chunk_scan_varlen(x, dt, A, B, C, 8, seq_idx=seq_idx, **options)

    def part(a, b):
        return mamba2.mamba2_chunk_scan_varlen_state(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], 8,
                                                     seq_idx=seq_idx[:, a:b], **options)

    y_first, state, _ = part(0, 40)
    y_second, _, alpha = part(40, 70)
    carried = alpha[..., None] * torch.einsum("bthn,bhpn->bthp", C[:, 40:].repeat_interleave(2, dim=2), state)
    assert (y_first - full[:, :40]).abs().max() <= SPLIT_TOLERANCE
    assert (y_second + carried - full[:, 40:]).abs().max() <= SPLIT_TOLERANCE
    assert (y_second - full[:, 40:]).abs().max() > 1e-2  # control: without the state


@pytest.mark.parametrize("documents", [[10, 20], [30]], ids=["two_documents", "one_document"])
def test_mamba2_state_fp64_gradcheck_and_opcheck(documents):
    """y, the final state and alpha against every input, with a row of one document (alpha reaches its end) and
    of two."""
    inputs = [t.requires_grad_() for t in _scan_inputs(30, rows=2, heads=2, head_dim=2, groups=1, state=3)]
    first = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))
    seq_idx = torch.stack([first, torch.tensor([2] * 25 + [3] * 5)]).to(torch.int32)

    def scan(x, dt, A, B, C, D, bias):
        return mamba2.mamba2_chunk_scan_varlen_state(x, dt, A, B, C, 4, D=D, dt_bias=bias, dt_softplus=True,
                                                     seq_idx=seq_idx)

    assert torch.autograd.gradcheck(scan, inputs)
    x, dt, A, B, C, D, bias = (t.detach().float().requires_grad_() for t in inputs)
    opcheck(mamba2.OP_STATE.forward, (x, dt, A, B, C, seq_idx, D, bias, 4, True, 0.0, float("inf"), "reference"))


@pytest.mark.parametrize("window", [None, 5])
def test_attention_with_its_own_key_boundaries_equals_the_rows_of_full_attention(window):
    """Queries of tokens 5-25 (the last queries of their documents so far) against the keys of tokens 0-25: the
    rows of attention over the whole 40 tokens; fp64 gradcheck; opcheck."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(40, 4, 8, generator=generator, dtype=F64)
    k, v = torch.randn(2, 40, 2, 8, generator=generator, dtype=F64).unbind(0)
    cu = _cu(0, 12, 13, 30, 40)
    full = attention.varlen_attention(q, k, v, cu, 17, window=window)
    start, end = 5, 25
    cu_q, cu_k = (cu.clamp(start, end) - start).to(torch.int32), cu.clamp(0, end).to(torch.int32)
    out = attention.varlen_attention_kv(q[start:end], k[:end], v[:end], cu_q, cu_k, 17, 17, window=window)
    assert (out - full[start:end]).abs().max() <= SPLIT_TOLERANCE
    leaves = [t[:end].clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: attention.varlen_attention_kv(a[start:], b, c, cu_q, cu_k, 17, 17, window=window), leaves)
    window_left = -1 if window is None else window - 1
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in leaves)
    opcheck(attention.OP_KV.forward, (q32[start:].detach().requires_grad_(), k32, v32, cu_q, None, cu_k, None, 17, 17,
                                      True, 8**-0.5, window_left, "reference"))


def test_attention_refuses_more_queries_than_keys():
    q, k, v = torch.randn(4, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="a document has 4 queries but 3 keys"):
        attention.varlen_attention_kv(q, k, v, _cu(0, 4), _cu(0, 3), 4, 3)


@pytest.mark.parametrize("world, matrix_schedule, scalar_schedule",
                         [(2, "sequential", "sequential"), (4, "sequential", "sequential"), (8, "log", "log"),
                          (128, "log", "log")])
def test_auto_schedule_sends_fewer_elements(world, matrix_schedule, scalar_schedule):
    """"auto" picks the schedule that sends fewer elements (log-depth on a tie): a [K, K] transform per head with
    K = V (the delta rules), a scalar per head (Mamba2)."""
    heads, key_dim = 32, 128
    state = heads * key_dim * key_dim
    assert chosen_schedule(state, state, world, "auto") == matrix_schedule
    assert chosen_schedule(heads, state, world, "auto") == scalar_schedule
    sequential, log = schedule_elements(state, state, world)
    assert sequential == (world - 1) * state
    assert log < sequential if matrix_schedule == "log" else log > sequential


@pytest.mark.parametrize("rule", list(DELTA_RULES))
def test_delta_rule_state_output_left_out_of_the_loss(rule):
    """An output that does not reach the loss (the final state, or o) counts as a zero gradient: the same gradients
    as with that output times zero in the loss, eager and compiled (one graph, AOT autograd tracing the zeros)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    _, state_op, _, per_channel = DELTA_RULES[rule]
    x = [t.requires_grad_() for t in _delta_inputs(40, per_channel, heads=1, value_heads=2, key_dim=4, value_dim=3)]
    initial = torch.randn(1, 2, 4, 3, dtype=F64, requires_grad=True)
    inputs, cu = [*x, initial], _cu(0, 17, 40)

    def grads(loss_of, run=state_op):
        return torch.autograd.grad(loss_of(*run(*x, cu, initial)), inputs)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(state_op, backend=counter, fullgraph=True)
    for alone, with_zero in (
        (lambda o, final: o.sum(), lambda o, final: o.sum() + (final * 0).sum()),
        (lambda o, final: final.sum(), lambda o, final: (o * 0).sum() + final.sum()),
    ):
        expected = grads(with_zero)
        for got in (grads(alone), grads(alone, compiled)):
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counter.frame_count == 1
