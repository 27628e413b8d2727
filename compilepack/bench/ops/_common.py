"""What the op benchmark modules share: the packed row's documents and boundaries, and stock-vs-packed timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

NAMES = ("stock", "packed")


def doc_lengths_of(T: int, n_docs: int, generator: torch.Generator) -> list[int]:
    """``n_docs`` random positive lengths summing to ``T``."""
    cuts = torch.randperm(T - 1, generator=generator)[: n_docs - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, T]
    return [end - start for start, end in zip(bounds[:-1], bounds[1:])]


def cu_seqlens_of(lengths: list[int], device: str) -> torch.Tensor:
    """``int32 [N+1]`` document boundaries, as the collators emit them."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def seq_idx_of(lengths: list[int], device: str) -> torch.Tensor:
    """``int32 [1, T]`` document index of every token, as the collators emit it."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.to(torch.int32)[None].to(device)


def delta_rule_case(stock_fn: Callable, varlen: Callable, inputs: list, cu_seqlens: torch.Tensor, device: str) -> dict:
    """A delta-rule op's case: transformers' chunk function (``q, k, v, g=, beta=``) on the packed row, without
    boundaries, vs the op with them (on fla on CUDA); both L2-normalise q and k."""
    backend = "fla" if device.startswith("cuda") else "reference"

    def stock():
        q, k, v, g, beta = inputs
        return stock_fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def packed():
        return varlen(*inputs, cu_seqlens, use_qk_l2norm=True, backend=backend)

    return {"stock": stock, "packed": packed, "inputs": inputs}


def alternating_ms(
    run: Callable[[str], object], warmup: int, repeats: int, *, sync: Callable[[], object] = lambda: None,
    clock: Callable[[], float] = time.perf_counter, swap: bool = False,
) -> dict[str, list[float]]:
    """Milliseconds of ``run("stock")`` and ``run("packed")``, one after the other in every round, so load from other
    processes hits both alike: ``warmup`` untimed rounds, then ``repeats`` timed ones. With ``swap`` the one that
    goes first alternates between rounds (packed first in round 0)."""
    times = {name: [] for name in NAMES}
    for repeat in range(warmup + repeats):
        for name in NAMES if not swap or repeat % 2 else NAMES[::-1]:
            sync()
            start = clock()
            run(name)
            sync()
            if repeat >= warmup:
                times[name].append((clock() - start) * 1e3)
    return times


def with_fresh_grads(case: dict, run: Callable) -> Callable[[str], None]:
    """For :func:`alternating_ms`: ``run(case[name])`` with the inputs' gradients cleared first (no accumulation into
    the previous ones)."""

    def run_fresh(name: str) -> None:
        for tensor in case["inputs"]:
            tensor.grad = None
        run(case[name])

    return run_fresh


def medians(times: dict[str, list[float]]) -> tuple[float, float, float]:
    """(stock ms, packed ms, packed/stock): medians over the repeats, the ratio the median of per-repeat ratios."""
    ratio = statistics.median(p / s for p, s in zip(times["packed"], times["stock"]))
    return statistics.median(times["stock"]), statistics.median(times["packed"]), ratio
