"""GPU check section: the sequence mode's ops (its state ops and gathered-key attention) on their kernels vs the
references, each on one rank's slice as the sequence mode builds it: a first document from an earlier rank (a nonzero
initial state; keys reaching back before the slice), 1-token and empty documents, two rows. Small on purpose
(2 x 1024 tokens): the section's time is the kernels' first JIT."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from compilepack.distributed import scan
from compilepack.ops.attention import varlen_attention_kv
from compilepack.ops.gated_delta_rule import gated_delta_rule_varlen_state
from compilepack.ops.kimi_delta_attention import kimi_delta_attention_varlen_state
from compilepack.ops.mamba2 import mamba2_chunk_scan_varlen_state

from .common import against_reference, cu_of, guarded, seq_idx_of

# a rank's slice of two rows: row 0 = (empty), 300 tokens of a document from the previous rank, 1, (empty), 723;
# row 1 = 1 token of a document from the previous rank, 64, 959
SLICE_LENGTHS, ROWS = [0, 300, 1, 0, 723, 1, 64, 959], 2
SIMULATED_SLICE_LENGTHS = [0, 10, 1, 0, 5, 1, 6, 9]
# gathered-key attention, rank 1 of 2 over rows of 2048: its queries are tokens 1024-2047, its keys 0-2047
ATTENTION_LENGTHS, ATTENTION_WORLD = [300, 1, 900, 847, 1024, 1000, 24], 2
SIMULATED_ATTENTION_LENGTHS = [3, 1, 9, 3, 8, 6, 2]


def _delta_rule_case(state_op, per_channel, lengths, device, width):
    generator = torch.Generator().manual_seed(0)
    randn, tokens = partial(torch.randn, generator=generator), (ROWS, sum(lengths) // ROWS)
    q, k, v = randn(*tokens, 2, width), randn(*tokens, 2, width), randn(*tokens, 4, width)
    decay = F.logsigmoid(randn(*tokens, 4, *((width,) if per_channel else ())) + 3)
    beta, initial = torch.rand(*tokens, 4, generator=generator), randn(ROWS, 4, width, width) * 0.1
    cu = cu_of(lengths, device)

    def call(inputs, backend):
        *tokens, h0 = inputs
        return state_op(*tokens, cu, h0, use_qk_l2norm=True, cu_seqlens_cpu=cu.cpu(), backend=backend)

    return call, [t.to(device) for t in (q, k, v, decay, beta, initial)]


def _mamba2_case(lengths, device, width):
    generator = torch.Generator().manual_seed(0)
    randn, tokens = partial(torch.randn, generator=generator), (ROWS, sum(lengths) // ROWS)
    x, dt, A = randn(*tokens, 8, width), randn(*tokens, 8) * 0.5 - 2, -torch.rand(8, generator=generator) - 0.5
    B, C = randn(*tokens, 1, 2 * width), randn(*tokens, 1, 2 * width)
    D, dt_bias = torch.rand(8, generator=generator), torch.rand(8, generator=generator) * 0.1
    seq_idx = seq_idx_of(lengths, device, ROWS) + 5  # a slice's global ids: the first is not 0

    def call(inputs, backend):
        x, dt, A, B, C, D, dt_bias = inputs
        return mamba2_chunk_scan_varlen_state(x, dt, A, B, C, 4 * width, D=D, dt_bias=dt_bias, dt_softplus=True,
                                              seq_idx=seq_idx, backend=backend)

    return call, [t.to(device) for t in (x, dt, A, B, C, D, dt_bias)]


def attention_case(lengths, device, width, kv_heads=2):
    length = sum(lengths) // ROWS
    local, cu = length // ATTENTION_WORLD, cu_of(lengths, "cpu")
    cu_q = scan.local_cu_seqlens(cu, ROWS, length, local * (ATTENTION_WORLD - 1), local)
    cu_k = scan.local_cu_seqlens(cu, ROWS, length, 0, length)
    randn = partial(torch.randn, generator=torch.Generator().manual_seed(0))
    q, k, v = randn(ROWS * local, 8, 2 * width), *(randn(ROWS * length, kv_heads, 2 * width) for _ in range(2))

    def call(inputs, backend):
        return (varlen_attention_kv(*inputs, cu_q.to(device), cu_k.to(device), local, length,
                                    cu_seqlens_q_cpu=cu_q, cu_seqlens_k_cpu=cu_k, backend=backend),)

    return call, [t.to(device) for t in (q, k, v)]


def check_sequence_ops(ctx):
    """Every sequence-mode op on each kernel library admitted for its op (refusals recorded, not run; simulated:
    the references, so the plumbing runs)."""
    lengths = SIMULATED_SLICE_LENGTHS if ctx.simulate else SLICE_LENGTHS
    attention_lengths = SIMULATED_ATTENTION_LENGTHS if ctx.simulate else ATTENTION_LENGTHS
    width = 8 if ctx.simulate else 64  # head width (K = V for the delta rules, P for Mamba2; twice it for attention)
    cases = {
        "gated_delta_rule_varlen_state": ("gated_delta_rule_varlen", lambda: _delta_rule_case(
            gated_delta_rule_varlen_state, False, lengths, ctx.device, width)),
        "kimi_delta_attention_varlen_state": ("kimi_delta_attention_varlen", lambda: _delta_rule_case(
            kimi_delta_attention_varlen_state, True, lengths, ctx.device, width)),
        "mamba2_chunk_scan_varlen_state": ("mamba2_chunk_scan_varlen", lambda: _mamba2_case(
            lengths, ctx.device, width)),
        "varlen_attention_kv": ("varlen_attention", lambda: attention_case(attention_lengths, ctx.device, width)),
    }
    results = []
    for name, (chosen_as, make) in cases.items():  # each state op takes its op's backend
        results += [{"op": name, "refused": key, "message": message}
                    for key, message in ctx.refusals(chosen_as).items()]
        if ctx.cuda and not ctx.admitted[chosen_as]:
            results.append({"op": name, "skipped": f"no admitted kernel for {chosen_as!r} on this machine"})
            continue
        for backend in ctx.paths(chosen_as):
            results.append(guarded({"op": name, "backend": backend}, lambda n=name, m=make, b=backend: {
                "op": n, **against_reference(*m(), b, ctx.dtype)}))
    return results
