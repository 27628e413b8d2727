"""Op-level checks of context parallelism over tokens, run on every rank of a gloo world (``worker.py`` spawns
them; ``test_sequence_parallel.py`` asserts on their figures): each op under the group's layout against the op on
one process, convs whose window reaches past the previous rank, the linear mixers' paths in one compiled function,
and the state pass's wall time."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tests.distributed.sequence_worker import _compiles, _without_passing, context_parallel
from tests.distributed.worker import _max_over_ranks, only_tokens_dynamic, op_against_one_process, static


# ------------------------------------------------------------------------------------------------ ops

# two rows of 96 tokens (divide by 2, 4 and 8): documents across one and several rank edges, 1-token documents
OP_ROWS = [[50, 1, 30, 15], [10, 1, 1, 84]]


def _op_cases() -> dict:
    """Each op on whole rows (one process) and under the group's layout on a rank's slices: ``name -> (cp_call,
    full_call, inputs [R, T, ...] sliced per rank, parameters replicated)``, for the rows ``OP_ROWS``."""
    from compilepack import Boundaries

    b = Boundaries.from_lengths([n for row in OP_ROWS for n in row], rows=len(OP_ROWS))
    calls = _op_calls(b.cu_seqlens, b.seq_idx, b.max_seqlen)
    inputs = _op_inputs(*b.seq_idx.shape)
    return {name: (*calls[name], *inputs[name]) for name in calls}


def _op_inputs(rows: int, total: int) -> dict:
    """Random inputs ``[R, T, ...]`` and parameters of every op case."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, low=False):
        x = torch.randn(*shape, generator=generator)
        return -x.abs() if low else x

    def qkv(heads, kv):
        return [rand(rows, total, heads, 16), rand(rows, total, kv, 16), rand(rows, total, kv, 16)]

    return {
        "attention": (qkv(4, 2), []),
        "attention_window": (qkv(4, 2), []),
        "causal_conv1d": ([rand(rows, total, 48)], [rand(48, 4), rand(48)]),
        "gated_delta_rule": ([rand(rows, total, 2, 16), rand(rows, total, 2, 16), rand(rows, total, 4, 16),
                              rand(rows, total, 4, low=True) / 4, torch.rand(rows, total, 4, generator=generator)], []),
        "kimi_delta_attention": ([rand(rows, total, 2, 16), rand(rows, total, 2, 16), rand(rows, total, 2, 16),
                                  rand(rows, total, 2, 16, low=True) / 4,
                                  torch.rand(rows, total, 2, generator=generator)], []),
        "mamba2_scan": ([rand(rows, total, 4, 8), rand(rows, total, 4), rand(rows, total, 2, 16),
                         rand(rows, total, 2, 16)], [rand(4, low=True), rand(4), rand(4)]),
    }


def _op_calls(cu: torch.Tensor, seq_idx: torch.Tensor, longest: int) -> dict:
    """``name -> (cp_call(cp, *inputs, *params), full_call(*inputs, *params))`` for the boundaries given."""
    from compilepack.ops.attention import varlen_attention
    from compilepack.ops.attention.sharded import varlen_attention_sharded
    from compilepack.ops.causal_conv1d import causal_conv1d_varlen
    from compilepack.ops.causal_conv1d.sharded import causal_conv1d_sharded
    from compilepack.ops.gated_delta_rule import gated_delta_rule_varlen
    from compilepack.ops.gated_delta_rule.sharded import gated_delta_rule_sharded
    from compilepack.ops.kimi_delta_attention import kimi_delta_attention_varlen
    from compilepack.ops.kimi_delta_attention.sharded import kimi_delta_attention_sharded
    from compilepack.ops.mamba2 import mamba2_chunk_scan_varlen
    from compilepack.ops.mamba2.sharded import mamba2_chunk_scan_sharded

    rows, total = seq_idx.shape

    def attention_full(q, k, v, window=None):
        flat = (x.reshape(rows * total, *x.shape[2:]) for x in (q, k, v))
        return varlen_attention(*flat, cu, longest, window=window).view(rows, total, q.shape[2], -1)

    def attention_cp(cp, q, k, v, window=None):
        return varlen_attention_sharded(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cu, longest, global_length=total, cp=cp,
            where="attention", cu_seqlens_cpu=cu, window=window, backend="reference",
        )

    def conv_full(x, weight, bias):
        return causal_conv1d_varlen(x.transpose(1, 2), weight, bias, seq_idx, "silu").transpose(1, 2)

    def conv_cp(cp, x, weight, bias):
        return causal_conv1d_sharded(x.transpose(1, 2), weight, bias, seq_idx, "silu", backend="reference",
                                              cp=cp).transpose(1, 2)

    def delta_full(op, *inputs):
        return op(*inputs, cu)

    def delta_cp(op, cp, *inputs):
        return op(*inputs, cu, cp=cp, where="delta rule", use_qk_l2norm=True, cu_seqlens_cpu=cu, backend="reference")

    def mamba_full(x, dt, B, C, A, D, dt_bias):
        return mamba2_chunk_scan_varlen(x, dt, A, B, C, 16, D=D, dt_bias=dt_bias, dt_softplus=True, seq_idx=seq_idx)

    def mamba_cp(cp, x, dt, B, C, A, D, dt_bias):
        return mamba2_chunk_scan_sharded(x, dt, A, B, C, 16, D=D, dt_bias=dt_bias, dt_softplus=True,
                                                  seq_idx=seq_idx, backend="reference", cp=cp)

    kda = functools.partial(kimi_delta_attention_varlen, use_qk_l2norm=True)
    return {
        "attention": (attention_cp, attention_full),
        "attention_window": (functools.partial(_windowed, attention_cp), functools.partial(_windowed, attention_full)),
        "causal_conv1d": (conv_cp, conv_full),
        "gated_delta_rule": (functools.partial(delta_cp, gated_delta_rule_sharded),
                             functools.partial(delta_full, gated_delta_rule_varlen)),
        "kimi_delta_attention": (functools.partial(delta_cp, kimi_delta_attention_sharded),
                                 functools.partial(delta_full, kda)),
        "mamba2_scan": (mamba_cp, mamba_full),
    }


def _windowed(call, *args):
    return call(*args, window=7)


def _rank_slice(total: int) -> slice:
    world, rank = dist.get_world_size(), dist.get_rank()
    return slice(rank * total // world, (rank + 1) * total // world)


def ops_equality(mode: str, state_pass: str = "auto") -> dict:
    """Each op under the group's layout == the op on one process: output, input gradients, parameter gradients summed
    over the ranks; control: the same without the state pass and the halo (the linear mixers, the conv), or each rank
    attending its own slice's keys only (attention: the op on the slice alone, documents cut at its edges)."""
    cp = context_parallel(mode, state_pass)
    figures = {}
    for name, (cp_call, full_call, inputs, params) in _op_cases().items():
        local = _rank_slice(inputs[0].shape[1])
        run = op_against_one_process(functools.partial(cp_call, cp), full_call, inputs, params, local)
        with torch.no_grad():
            if name.startswith("attention"):
                control = _attention_alone(name, run["mine"])
            else:
                with _without_passing():
                    control = cp_call(cp, *run["mine"], *run["my_params"])
        figures[name] = {"output": run["output"], "grads": run["grads"],
                         "control": _max_over_ranks((control - run["expected"]).abs().max())}
    return figures


def _attention_alone(name: str, inputs: list) -> torch.Tensor:
    """Attention on this rank's slice alone, its documents cut at the slice edges."""
    from compilepack import Boundaries
    from compilepack.ops.attention import varlen_attention

    b = Boundaries.from_lengths([n for row in OP_ROWS for n in row], rows=len(OP_ROWS))
    seq_idx = b.seq_idx[:, _rank_slice(b.seq_idx.shape[1])]
    lengths = [n for row in seq_idx for n in torch.unique_consecutive(row, return_counts=True)[1].tolist()]
    local = Boundaries.from_lengths(lengths, rows=seq_idx.shape[0])
    q, k, v = (x.reshape(-1, *x.shape[2:]) for x in inputs)
    window = 7 if name == "attention_window" else None
    out = varlen_attention(q, k, v, local.cu_seqlens, local.max_seqlen, window=window)
    return out.view(*inputs[0].shape[:3], -1)


def conv_short_slices() -> dict:
    """The conv over tokens when a slice is shorter than its window (2 tokens per rank; 4 and 7 taps): every slice
    is gathered; output and gradients equal the conv on one process; control: the slice alone."""
    from compilepack import Boundaries
    from compilepack.ops.causal_conv1d import causal_conv1d_varlen
    from compilepack.ops.causal_conv1d.sharded import causal_conv1d_sequence_parallel

    cp = context_parallel("sequence")
    world, rank = dist.get_world_size(), dist.get_rank()
    lengths = [[1, 2 * world - 1], [2 * world]]  # a document across every rank edge of the second row
    b = Boundaries.from_lengths([n for row in lengths for n in row], rows=2)
    local = slice(2 * rank, 2 * rank + 2)
    generator = torch.Generator().manual_seed(0)
    figures = {}
    for taps in (4, 7):
        x = torch.randn(2, 12, 2 * world, generator=generator).requires_grad_()
        weight, bias = (torch.randn(*shape, generator=generator).requires_grad_() for shape in ((12, taps), (12,)))
        expected = causal_conv1d_varlen(x, weight, bias, b.seq_idx, "silu")
        expected.square().sum().backward()
        mine = x.detach()[:, :, local].clone().requires_grad_()
        my_weight, my_bias = (t.detach().clone().requires_grad_() for t in (weight, bias))
        out = causal_conv1d_sequence_parallel(mine, my_weight, my_bias, b.seq_idx, "silu", backend="reference", cp=cp)
        out.square().sum().backward()
        for t in (my_weight, my_bias):
            dist.all_reduce(t.grad)
        grads = [(mine.grad - x.grad[:, :, local]).abs().max(), (my_weight.grad - weight.grad).abs().max(),
                 (my_bias.grad - bias.grad).abs().max()]
        scale = max(t.grad.abs().max() for t in (x, weight, bias))
        alone = causal_conv1d_varlen(mine.detach(), weight.detach(), bias.detach(), b.seq_idx[:, local], "silu")
        figures[f"taps{taps}"] = {
            "output": _max_over_ranks((out - expected[:, :, local]).abs().max()),
            "grads": _max_over_ranks(torch.stack(grads).max() / scale),
            "control": _max_over_ranks((alone - expected[:, :, local]).abs().max()),
        }
    return figures




# ------------------------------------------------------------------------------------------------ compiling


def compile_ops(mode: str, state_pass: str = "auto") -> dict:
    """The linear mixers' and the conv's context-parallel paths (conv, gated delta rule, KDA, Mamba2 scan, the state
    passes and halos included) in one function compiled with aot_eager (fullgraph, dynamic; the heads, widths and
    parameters static, as in a model: ``worker.only_tokens_dynamic``), the boundaries among its inputs as in a model,
    forward + backward, over three batches of different row lengths and documents: one graph per rank, compiled
    once; compiled == eager."""
    from compilepack import Boundaries

    cp = context_parallel(mode, state_pass)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    names = ["causal_conv1d", "gated_delta_rule", "kimi_delta_attention", "mamba2_scan"]

    def run_all(cu, seq_idx, *flat):
        calls = _op_calls(cu, seq_idx, 0)
        outs, at = [], 0
        for name, count in zip(names, counts):
            outs.append(calls[name][0](cp, *flat[at : at + count]).square().sum())
            at += count
        return torch.stack(outs).sum()

    compiled_function = torch.compile(run_all, backend="aot_eager", fullgraph=True, dynamic=True)
    error = 0.0
    # rows of 104, 88 and 120 tokens: no slice length at W = 2, 4, 8 equals another size of the inputs (the compiler
    # would guard on the equality and recompile when it breaks: duck sizing)
    for rows in ([[50, 1, 30, 23], [10, 1, 1, 92]], [[20, 68], [1, 87]], [[3, 70, 47], [120]]):
        b = Boundaries.from_lengths([n for row in rows for n in row], rows=len(rows))
        inputs = _op_inputs(*b.seq_idx.shape)
        local = _rank_slice(b.seq_idx.shape[1])
        flat, counts = [], []
        for name in names:
            tensors, params = inputs[name]
            flat += [only_tokens_dynamic(t[:, local].clone().requires_grad_()) for t in tensors]
            flat += [static(p.clone().requires_grad_()) for p in params]
            counts.append(len(tensors) + len(params))
        compiled = compiled_function(b.cu_seqlens, b.seq_idx, *flat)
        compiled_grads = torch.autograd.grad(compiled, flat)
        eager = run_all(b.cu_seqlens, b.seq_idx, *flat)
        eager_grads = torch.autograd.grad(eager, flat)
        errors = [(compiled - eager).abs() / eager.abs()]
        errors += [(a - b).abs().max() / b.abs().max() for a, b in zip(compiled_grads, eager_grads)]
        error = max(error, torch.stack(errors).max().item())
    return {**_compiles(graphs_before), "compiled_vs_eager": _max_over_ranks(torch.tensor(error))}


# ------------------------------------------------------------------------------------------------ the state pass


def state_pass_timing(heads: int = 32, key_dim: int = 128, value_dim: int = 128, repeats: int = 5) -> dict:
    """Wall time of one state pass (forward + backward) of Gated DeltaNet-sized states (``[1, heads, K, V]`` fp32,
    a ``[K, K]`` transform per head) and of Mamba2-sized ones (a scalar transform) over the world, both schedules:
    the median over ``repeats`` (after one warm-up), the slowest rank's. Not asserted: gloo on shared CPU cores."""
    import time

    from compilepack.distributed import scan

    cp = context_parallel("sequence")
    generator = torch.Generator().manual_seed(dist.get_rank())
    figures = {}
    for name, transform_shape in (("matrix", (1, heads, key_dim, key_dim)), ("scalar", (1, heads))):
        for schedule in ("sequential", "log"):
            times = []
            for _ in range(repeats + 1):
                transform = (torch.rand(*transform_shape, generator=generator) / key_dim).requires_grad_()
                final = torch.randn(1, heads, key_dim, value_dim, generator=generator).requires_grad_()
                continues = torch.ones(1, dtype=torch.bool)
                dist.barrier()
                start = time.perf_counter()
                incoming = scan.incoming_states(transform, final, continues, cp, schedule)
                incoming.square().sum().backward()
                times.append(time.perf_counter() - start)
            figures[f"{name}:{schedule}"] = _max_over_ranks(torch.tensor(sorted(times[1:])[repeats // 2]))
    return figures
