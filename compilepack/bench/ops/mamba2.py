"""Benchmark helper: stock transformers ``mamba2_chunk_scan`` vs ``compilepack::mamba2_chunk_scan_varlen``.

Sizes of one small Bamba-style Mamba2 layer (hidden 256, expand 2): 8 heads of width 64 (512 channels), one
B/C group, state 64, chunk 256 (Bamba's default; 64 is measured too), one packed row (b = 1). dt, A, D and
dt_bias are made as the model makes them (softplus-ed dt around 0.1, A = -exp(A_log) in [-8, -1]). The stock
function runs on the packed row without boundaries (wrong, but the cost baseline).
"""

from __future__ import annotations

import torch

NAME = "mamba2"


def doc_lengths_of(T: int, n_docs: int, generator: torch.Generator) -> list[int]:
    """``n_docs`` random positive lengths summing to ``T``."""
    cuts = torch.randperm(T - 1, generator=generator)[: n_docs - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, T]
    return [end - start for start, end in zip(bounds[:-1], bounds[1:])]


def _seq_idx(lengths: list[int], device: str) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.to(torch.int32)[None].to(device)


def _backend(device: str) -> str:
    return "mamba_ssm" if device.startswith("cuda") else "reference"


def setup(
    T: int = 2048,
    n_docs: int = 16,
    device: str = "cpu",
    seed: int = 0,
    *,
    chunk_size: int = 256,
    heads: int = 8,
    head_dim: int = 64,
    groups: int = 1,
    state_size: int = 64,
) -> dict:
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    from compilepack.ops.mamba2 import mamba2_chunk_scan_varlen

    generator = torch.Generator().manual_seed(seed)
    seq_idx = _seq_idx(doc_lengths_of(T, n_docs, generator), device)
    x = torch.randn(1, T, heads, head_dim, generator=generator)
    dt = torch.randn(1, T, heads, generator=generator) - 2.0
    A = -torch.empty(heads).uniform_(1.0, 8.0, generator=generator)
    B = torch.randn(1, T, groups, state_size, generator=generator)
    C = torch.randn(1, T, groups, state_size, generator=generator)
    D = torch.ones(heads)
    dt_bias = torch.rand(heads, generator=generator)
    inputs = [t.to(device).requires_grad_() for t in (x, dt, A, B, C, D, dt_bias)]
    backend = _backend(device)

    def stock():
        x, dt, A, B, C, D, dt_bias = inputs
        return mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True)

    def packed():
        x, dt, A, B, C, D, dt_bias = inputs
        return mamba2_chunk_scan_varlen(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
                                        seq_idx=seq_idx, backend=backend)

    return {"stock": stock, "packed": packed, "inputs": inputs}


def _main() -> None:
    """Stock vs packed on 2 threads. Timings alternate stock and packed so that load from other processes
    hits both alike; each number is a median over repeats, the ratio the median of per-repeat ratios."""
    import statistics
    import time

    from transformers.utils import logging

    logging.set_verbosity_error()  # the stock functions warn once that mamba-ssm is not installed
    torch.set_num_threads(2)

    def once_ms(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    cases = [(f"scan chunk {c}", setup(chunk_size=c)) for c in (64, 256)]
    for label, case in cases:
        grad = torch.randn_like(case["stock"]().detach())
        modes = {"fwd": lambda fn: fn(), "fwd+bwd": lambda fn: fn().backward(grad)}
        for mode, run in modes.items():
            times = {"stock": [], "packed": []}
            for repeat in range(9):
                for name in ("stock", "packed") if repeat % 2 else ("packed", "stock"):
                    for tensor in case["inputs"]:
                        tensor.grad = None
                    times[name].append(once_ms(lambda: run(case[name])))
            times = {name: values[2:] for name, values in times.items()}  # warm-up
            ratio = statistics.median(p / s for p, s in zip(times["packed"], times["stock"]))
            print(f"{label:>14} {mode:>8}: stock {statistics.median(times['stock']):7.1f} ms  "
                  f"packed {statistics.median(times['packed']):7.1f} ms  ratio {ratio:.2f}")


if __name__ == "__main__":
    _main()
