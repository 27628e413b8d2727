"""Op-level checks of Ulysses context parallelism, run on every rank of a gloo world (``worker.py`` spawns them;
``test_context_parallel.py`` asserts on their figures): each op head-parallel against the op on one process, and
the ops compiled in one function."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed.worker import _max_over_ranks, _world, only_tokens_dynamic, op_against_one_process, static


# ------------------------------------------------------------------------------------------------ op level

OP_LENGTHS = [70, 1, 23, 5, 33]  # 132 tokens: divides by 2 and 4; the 70-token document straddles the splits


def _op_cases(total: int) -> dict:
    """Each op under CP and alone: (cp_call(local inputs, params), full_call(inputs, params), inputs, params).
    Inputs are [R, T, ...] token tensors (sliced per rank); params are replicated (gradients summed)."""
    from compilepack import Boundaries
    from compilepack.distributed import ContextParallel
    from compilepack.ops.attention import varlen_attention
    from compilepack.ops.attention.sharded import varlen_attention_head_parallel
    from compilepack.ops.causal_conv1d import causal_conv1d_varlen
    from compilepack.ops.causal_conv1d.sharded import causal_conv1d_head_parallel
    from compilepack.ops.gated_delta_rule import gated_delta_rule_varlen
    from compilepack.ops.gated_delta_rule.sharded import gated_delta_rule_head_parallel
    from compilepack.ops.mamba2 import mamba2_chunk_scan_varlen
    from compilepack.ops.mamba2.sharded import mamba2_chunk_scan_head_parallel

    cp = ContextParallel.of(_world())
    b = Boundaries.from_lengths(OP_LENGTHS)
    cu, seq_idx, longest = b.cu_seqlens, b.seq_idx, b.max_seqlen
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, low=None):
        x = torch.randn(*shape, generator=generator)
        return -x.abs() if low else x

    def attention_full(q, k, v):
        return varlen_attention(q[0], k[0], v[0], cu, longest)[None]

    def attention_cp(q, k, v):
        return varlen_attention_head_parallel(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cu, longest, global_length=total, cp=cp,
            where="attention", cu_seqlens_cpu=cu,
        )

    def conv_full(x, weight, bias):
        return causal_conv1d_varlen(x.transpose(1, 2), weight, bias, seq_idx, "silu").transpose(1, 2)

    def conv_cp(x, weight, bias):
        return causal_conv1d_head_parallel(x.transpose(1, 2), weight, bias, seq_idx, "silu", backend="reference",
                                           cp=cp).transpose(1, 2)

    def gdn_full(q, k, v, g, beta):
        return gated_delta_rule_varlen(q, k, v, g, beta, cu)

    def gdn_cp(q, k, v, g, beta):
        return gated_delta_rule_head_parallel(q, k, v, g, beta, cu, cp=cp, where="gdn", cu_seqlens_cpu=cu)

    def mamba_full(x, dt, B, C, A, D, dt_bias):
        return mamba2_chunk_scan_varlen(x, dt, A, B, C, 32, D=D, dt_bias=dt_bias, dt_softplus=True, seq_idx=seq_idx)

    def mamba_cp(x, dt, B, C, A, D, dt_bias):
        return mamba2_chunk_scan_head_parallel(
            x, dt, A, B, C, 32, D=D, dt_bias=dt_bias, dt_softplus=True, seq_idx=seq_idx, backend="reference", cp=cp,
        )

    return {
        # 4 query heads over 2 kv heads: split for W = 2, replicated for W = 4
        "attention": (attention_cp, attention_full,
                      [rand(1, total, 4, 16), rand(1, total, 2, 16), rand(1, total, 2, 16)], []),
        "causal_conv1d": (conv_cp, conv_full, [rand(1, total, 48)], [rand(48, 4), rand(48)]),
        # 2 q/k heads under 4 value heads: split for W = 2, replicated for W = 4
        "gated_delta_rule": (gdn_cp, gdn_full, [rand(1, total, 2, 16), rand(1, total, 2, 16), rand(1, total, 4, 16),
                                                rand(1, total, 4, low=True) / 4,
                                                torch.rand(1, total, 4, generator=generator)], []),
        # 4 heads over 2 groups: groups split for W = 2, replicated for W = 4
        "mamba2_scan": (mamba_cp, mamba_full, [rand(1, total, 4, 8), rand(1, total, 4), rand(1, total, 2, 16),
                                               rand(1, total, 2, 16)], [rand(4, low=True), rand(4), rand(4)]),
    }


def ops_equality() -> dict:
    """Each op under CP == the op on one process: output, input gradients, summed parameter gradients; control:
    the op on the rank's own slice with its own boundaries (what runs without the all-to-alls)."""
    total = sum(OP_LENGTHS)
    world, rank = dist.get_world_size(), dist.get_rank()
    local = slice(rank * total // world, (rank + 1) * total // world)
    figures = {}
    for name, (cp_call, full_call, inputs, params) in _op_cases(total).items():
        run = op_against_one_process(cp_call, full_call, inputs, params, local)
        control = _without_cp(name, run["mine"], run["my_params"])
        figures[name] = {"output": run["output"], "grads": run["grads"],
                         "control": _max_over_ranks((control - run["expected"]).abs().max())}
    return figures


def _without_cp(name: str, inputs: list, params: list) -> torch.Tensor:
    """The op on this rank's slice alone, with the documents cut at the slice edges."""
    from compilepack import Boundaries
    from compilepack.ops.attention import varlen_attention
    from compilepack.ops.causal_conv1d import causal_conv1d_varlen
    from compilepack.ops.gated_delta_rule import gated_delta_rule_varlen
    from compilepack.ops.mamba2 import mamba2_chunk_scan_varlen

    total, world, rank = sum(OP_LENGTHS), dist.get_world_size(), dist.get_rank()
    seq_idx = Boundaries.from_lengths(OP_LENGTHS).seq_idx[:, rank * total // world : (rank + 1) * total // world]
    b = Boundaries.from_lengths(torch.unique_consecutive(seq_idx[0], return_counts=True)[1].tolist())
    with torch.no_grad():
        if name == "attention":
            return varlen_attention(*(x[0] for x in inputs), b.cu_seqlens, b.max_seqlen)[None]
        if name == "causal_conv1d":
            return causal_conv1d_varlen(inputs[0].transpose(1, 2), *params, b.seq_idx, "silu").transpose(1, 2)
        if name == "gated_delta_rule":
            return gated_delta_rule_varlen(*inputs, b.cu_seqlens)
        x, dt, B, C = inputs
        A, D, dt_bias = params
        return mamba2_chunk_scan_varlen(x, dt, A, B, C, 32, D=D, dt_bias=dt_bias, dt_softplus=True, seq_idx=b.seq_idx)


def ops_compile() -> dict:
    """The hybrids' CP ops (conv, gated delta rule, Mamba2 scan; attention is compiled in compile_check's Llama) in
    one function compiled with aot_eager (fullgraph, dynamic; the heads, widths and parameters static, as in a model:
    ``worker.only_tokens_dynamic``), forward + backward, over three row lengths: the all-to-alls stay in one graph;
    compiled == eager."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    error = 0.0
    for lengths in ([70, 1, 23, 5, 33], [12, 40, 8, 4], [3, 50, 9, 1, 17, 33, 5, 2]):
        global OP_LENGTHS
        OP_LENGTHS = lengths
        total = sum(lengths)
        cases = {name: case for name, case in _op_cases(total).items() if name != "attention"}
        world, rank = dist.get_world_size(), dist.get_rank()
        local = slice(rank * total // world, (rank + 1) * total // world)

        def run_all(*flat):
            outs, at = [], 0
            for cp_call, _, inputs, params in cases.values():
                n = len(inputs) + len(params)
                outs.append(cp_call(*flat[at : at + n]).sum())
                at += n
            return torch.stack(outs).sum()

        flat = [only_tokens_dynamic(t[:, local].clone().requires_grad_()) if i < len(inputs)
                else static(t.clone().requires_grad_())
                for _, _, inputs, params in cases.values() for i, t in enumerate(inputs + params)]
        compiled = torch.compile(run_all, backend=counter, fullgraph=True, dynamic=True)(*flat)
        compiled_grads = torch.autograd.grad(compiled, flat)
        eager = run_all(*flat)
        eager_grads = torch.autograd.grad(eager, flat)
        grad_errors = ((a - b).abs().max().item() for a, b in zip(compiled_grads, eager_grads))
        error = max(error, (compiled - eager).abs().item(), *grad_errors)
    OP_LENGTHS = [70, 1, 23, 5, 33]
    return {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before,
            "backend_calls": counter.frame_count, "compiled_vs_eager": _max_over_ranks(torch.tensor(error))}
