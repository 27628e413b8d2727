"""What the op benchmark modules share: the packed row's documents and boundaries, and stock-vs-packed timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

NAMES = ("stock", "packed")


def doc_lengths_of(T: int, n_docs: int, generator: torch.Generator, equal: bool = False) -> list[int]:
    """``n_docs`` positive lengths summing to ``T``: random, or all ``T / n_docs`` with ``equal``."""
    if equal:
        if T % n_docs:
            raise ValueError(f"equal-length documents need T divisible by n_docs; got T={T}, n_docs={n_docs}")
        return [T // n_docs] * n_docs
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


def as_rows(x: torch.Tensor, n_docs: int, time_dim: int) -> torch.Tensor:
    """A ``[1, ...]`` packed-row tensor of ``n_docs`` equal-length documents as the batch of those documents: the
    time dimension split into ``[n_docs, L]``, the documents first (a view, no copy)."""
    return x[0].unflatten(time_dim - 1, (n_docs, -1)).movedim(time_dim - 1, 0)


def equal_lengths_case(case: dict, batched: Callable, equal_lengths: bool) -> dict:
    """``case`` with ``batched`` added when its documents are equal-length: the stock function on the ``[n_docs, L]``
    batch of the same tokens, no padding (what grouping by length approaches at best)."""
    return {**case, "batched": batched} if equal_lengths else case


def delta_rule_case(
    stock_fn: Callable, varlen: Callable, inputs: list, cu_seqlens: torch.Tensor, device: str, equal_docs: int | None
) -> dict:
    """A delta-rule op's case: transformers' chunk function (``q, k, v, g=, beta=``) on the packed row, without
    boundaries, vs the op with them (on fla on CUDA); both L2-normalise q and k. With ``equal_docs`` equal-length
    documents, also the stock function on their batch."""
    backend = "fla" if device.startswith("cuda") else "reference"

    def stock(rows: int | None = None):
        q, k, v, g, beta = (as_rows(x, rows, 1) for x in inputs) if rows else inputs
        return stock_fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def packed():
        return varlen(*inputs, cu_seqlens, use_qk_l2norm=True, backend=backend)

    case = {"stock": stock, "packed": packed, "inputs": inputs}
    return equal_lengths_case(case, lambda: stock(equal_docs), equal_docs is not None)


def alternating_ms(run: Callable[[str], object], warmup: int, repeats: int, *,
                   sync: Callable[[], object] = lambda: None) -> dict[str, list[float]]:
    """Milliseconds of ``run("stock")`` and ``run("packed")``, one after the other in every round, so load from other
    processes hits both alike: ``warmup`` untimed rounds, then ``repeats`` timed ones."""
    times = {name: [] for name in NAMES}
    for repeat in range(warmup + repeats):
        for name in NAMES:
            sync()
            start = time.perf_counter()
            run(name)
            sync()
            if repeat >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def medians(times: dict[str, list[float]]) -> tuple[float, float, float]:
    """(stock ms, packed ms, packed/stock): medians over the repeats, the ratio the median of per-repeat ratios."""
    ratio = statistics.median(p / s for p, s in zip(times["packed"], times["stock"]))
    return statistics.median(times["stock"]), statistics.median(times["packed"]), ratio
