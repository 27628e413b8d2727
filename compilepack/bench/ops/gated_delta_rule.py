"""Benchmark helper: stock transformers ``torch_chunk_gated_delta_rule`` vs ``compilepack::gated_delta_rule_varlen``.

Sizes of one small Qwen3.5-style Gated DeltaNet layer: 4 q/k heads, 8 value heads (grouped), head dim 64
(value dim 512), one packed row (B = 1); g and beta made as the model makes them (log-sigmoid-like decay <= 0,
sigmoid beta). The stock function runs on the packed row without boundaries (wrong, but the cost baseline).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "gated_delta_rule"


def doc_lengths_of(T: int, n_docs: int, generator: torch.Generator) -> list[int]:
    """``n_docs`` random positive lengths summing to ``T``."""
    cuts = torch.randperm(T - 1, generator=generator)[: n_docs - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, T]
    return [end - start for start, end in zip(bounds[:-1], bounds[1:])]


def setup(
    T: int = 2048,
    n_docs: int = 16,
    device: str = "cpu",
    seed: int = 0,
    *,
    num_k_heads: int = 4,
    num_v_heads: int = 8,
    head_dim: int = 64,
) -> dict:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from compilepack.ops.gated_delta_rule import gated_delta_rule_varlen

    generator = torch.Generator().manual_seed(seed)
    lengths = doc_lengths_of(T, n_docs, generator)
    cu_seqlens = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).to(device)
    q = torch.randn(1, T, num_k_heads, head_dim, generator=generator)
    k = torch.randn(1, T, num_k_heads, head_dim, generator=generator)
    v = torch.randn(1, T, num_v_heads, head_dim, generator=generator)
    g = F.logsigmoid(torch.randn(1, T, num_v_heads, generator=generator) + 2)
    beta = torch.randn(1, T, num_v_heads, generator=generator).sigmoid()
    inputs = [x.to(device).requires_grad_() for x in (q, k, v, g, beta)]
    backend = "fla" if device.startswith("cuda") else "reference"

    def stock():
        q, k, v, g, beta = inputs
        return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def packed():
        return gated_delta_rule_varlen(*inputs, cu_seqlens, backend=backend)

    return {"stock": stock, "packed": packed, "inputs": inputs}


def _main() -> None:
    """Stock vs packed on 2 threads. Timings alternate stock and packed so that load from other processes
    hits both alike; the ratio is the median of the per-repeat ratios."""
    import statistics
    import time

    from transformers.utils import logging

    logging.set_verbosity_error()  # the stock function warns once that fla is not installed
    torch.set_num_threads(2)

    def once_ms(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    for heads, dim in (((4, 8), 64), ((4, 4), 128)):
        case = setup(num_k_heads=heads[0], num_v_heads=heads[1], head_dim=dim)
        grad = torch.randn(1, 2048, heads[1], dim)
        modes = {
            "fwd": lambda fn: torch.no_grad()(fn)(),
            "fwd+bwd": lambda fn: fn().backward(grad),
        }
        for mode, run in modes.items():
            times = {"stock": [], "packed": []}
            for repeat in range(14):
                for name in times:
                    elapsed = once_ms(lambda: run(case[name]))
                    if repeat >= 2:  # warm-up
                        times[name].append(elapsed)
            ratio = statistics.median(p / s for p, s in zip(times["packed"], times["stock"]))
            stock, packed = statistics.median(times["stock"]), statistics.median(times["packed"])
            print(
                f"H={heads[0]} HV={heads[1]} K=V={dim} T=2048 16 docs {mode:8s} stock {stock:7.1f} ms  "
                f"packed {packed:7.1f} ms  packed/stock {ratio:.2f}x"
            )


if __name__ == "__main__":
    _main()
