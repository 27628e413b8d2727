"""Benchmark helper: stock transformers ``chunk_kimi_delta_attention`` (its torch fallback) vs
``compilepack::kimi_delta_attention_varlen``.

Sizes of one small Kimi-Linear-style KDA layer: 4 heads of dim 64 (hidden 256; Kimi Linear has as many value
heads as q/k heads), one packed row (B = 1); g made as Kimi's forget gate makes it (``-exp(A_log) *
softplus(x + dt_bias)`` with fla's initialisation ranges: a per-channel log decay <= 0), sigmoid beta. The stock
function runs on the packed row without boundaries (wrong, but the cost baseline). It is slow on CPU (seconds
per call at T = 2048: a Python loop over chunk rows, under autograd), so ``_main`` times fewer repeats.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from ._common import alternating_ms, cu_seqlens_of, delta_rule_case, doc_lengths_of, medians

NAME = "kimi_delta_attention"


def kimi_gate(T: int, heads: int, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    """``[1, T, heads, head_dim]`` log decays as ``KimiLinearForgetGate`` computes them at initialisation."""
    A_log = torch.empty(heads, 1).uniform_(1.0, 16.0, generator=generator).log()
    dt = torch.empty(heads * head_dim).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).view(heads, head_dim)  # inverse softplus, as fla initialises
    projection = torch.randn(1, T, heads, head_dim, generator=generator)
    return -A_log.exp() * F.softplus(projection + dt_bias)


def setup(
    T: int = 2048, n_docs: int = 16, device: str = "cpu", seed: int = 0, *, heads: int = 4, head_dim: int = 64,
    equal_lengths: bool = False,
) -> dict:
    from transformers.models.kimi_linear import modeling_kimi_linear

    from compilepack.ops.kimi_delta_attention import kimi_delta_attention_varlen

    # the torch fallback itself: the hub-kernel wrapper around it only adds a warning and a kwargs filter
    stock_kda = inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)
    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = cu_seqlens_of(doc_lengths_of(T, n_docs, generator, equal_lengths), device)
    q, k, v = (torch.randn(1, T, heads, head_dim, generator=generator) for _ in range(3))
    g = kimi_gate(T, heads, head_dim, generator)
    beta = torch.randn(1, T, heads, generator=generator).sigmoid()
    inputs = [x.to(device).requires_grad_() for x in (q, k, v, g, beta)]
    return delta_rule_case(stock_kda, kimi_delta_attention_varlen, inputs, cu_seqlens, device,
                           n_docs if equal_lengths else None)


def _main() -> None:
    """Stock vs packed: ``python -m benchmarks ops.kimi_delta_attention [repeats] [threads] [head_dims]``.

    Timings alternate stock and packed so that load from other processes hits both alike; the ratio is the
    median of the per-repeat ratios. With 1 thread the clock is the process's CPU time, which other processes
    on shared cores do not inflate; with more, wall time (a loaded machine stretches every multi-threaded call).
    """
    import sys
    import time

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    head_dims = [int(d) for d in sys.argv[3].split(",")] if len(sys.argv) > 3 else [64, 128]
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    for dim in head_dims:
        heads = 4
        case = setup(heads=heads, head_dim=dim)
        grad = torch.randn(1, 2048, heads, dim)
        modes = {"fwd": lambda fn: torch.no_grad()(fn)(), "fwd+bwd": lambda fn: fn().backward(grad)}
        for mode, run in modes.items():
            times = alternating_ms(lambda name: run(case[name]), warmup=1, repeats=repeats, clock=clock)
            stock, packed, ratio = medians(times)
            print(
                f"{threads} thread(s) H=HV={heads} K=V={dim} T=2048 16 docs {mode:8s} stock {stock:8.1f} ms  "
                f"packed {packed:7.1f} ms  packed/stock {ratio:.3f}x",
                flush=True,
            )


if __name__ == "__main__":
    _main()
