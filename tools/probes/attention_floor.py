"""Is the packed attention op the lever for Llama's grouped bar? Times it against stock's batched call on the
default bench run's own documents, and two ways of batching documents that were tried to make it faster.

For each timed round of the default run (Llama bench widths: 8 query / 4 kv heads of 32, fp32, forward +
backward, ms per 8192 real tokens):

- ``packed``: ``compilepack.ops.varlen_attention`` on the round's arrival step (one CPU flash-attention call per
  document, causal);
- ``grouped``: stock's call on the round's three length-grouped batches, ``scaled_dot_product_attention`` with the
  boolean padding + causal mask transformers builds for a padded batch;
- ``kernels``: only the CPU flash-attention calls the packed op makes (forward and backward per document, on
  strided token slices), without the op's copies and autograd: the op's overhead is ``packed - kernels``;
- ``bucketed``: the arrival step's documents right-padded into batches by length (buckets of 32 tokens), one
  causal call per bucket (exact without a mask: a right pad is only ever seen by later pads); copies excluded;
- ``heads_first``: the whole row transposed to ``[heads, T, dim]`` once, then per-document calls on contiguous
  head slices (the transposes included, the output's way back to ``[T, heads, dim]`` not).

Run: ``OMP_NUM_THREADS=2 python -m tools.probes.attention_floor`` (about a minute on 2 cores).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from benchmarks.modes import Workload
from compilepack.ops.attention import varlen_attention

HEADS, KV_HEADS, DIM = 8, 4, 32
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def packed(lengths: list[int]) -> float:
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(total, HEADS, DIM, requires_grad=True)
    k, v = (torch.randn(total, KV_HEADS, DIM, requires_grad=True) for _ in range(2))
    grad = torch.randn(total, HEADS, DIM)
    return _timed(lambda: varlen_attention(q, k, v, cu, max(lengths), cu_seqlens_cpu=cu).backward(grad))


def grouped(batches: list[list[int]]) -> float:
    seconds = 0.0
    for lengths in batches:
        rows, longest = len(lengths), max(lengths)
        q = torch.randn(rows, HEADS, longest, DIM, requires_grad=True)
        k, v = (torch.randn(rows, KV_HEADS, longest, DIM, requires_grad=True) for _ in range(2))
        valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        mask = torch.ones(longest, longest, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]

        def step():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            out.backward(torch.ones_like(out))

        seconds += _timed(step)
    return seconds


def _flash_both_ways(q, k, v) -> None:
    out, lse = FLASH(q, k, v, 0.0, True, scale=DIM**-0.5)
    FLASH_BACKWARD(torch.ones_like(out), q, k, v, out, lse, 0.0, True, scale=DIM**-0.5)


def bucketed(lengths: list[int], width: int = 32) -> float:
    buckets: dict[int, int] = {}
    for length in lengths:
        padded = math.ceil(length / width) * width
        buckets[padded] = buckets.get(padded, 0) + 1
    seconds = 0.0
    for padded, rows in buckets.items():
        q = torch.randn(rows, HEADS, padded, DIM)
        k, v = (torch.randn(rows, KV_HEADS, padded, DIM) for _ in range(2))
        seconds += _timed(lambda: _flash_both_ways(q, k, v))
    return seconds


def kernels(lengths: list[int]) -> float:
    total = sum(lengths)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, k, v = (torch.randn(total, heads, DIM) for heads in (HEADS, KV_HEADS, KV_HEADS))

    def work():
        for start, end in zip(bounds[:-1], bounds[1:]):
            _flash_both_ways(*(x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)))

    return _timed(work)


def heads_first(lengths: list[int]) -> float:
    total = sum(lengths)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q_tokens = torch.randn(total, HEADS, DIM)
    k_tokens, v_tokens = (torch.randn(total, KV_HEADS, DIM) for _ in range(2))

    def work():
        q, k, v = (x.transpose(0, 1).contiguous() for x in (q_tokens, k_tokens, v_tokens))
        for start, end in zip(bounds[:-1], bounds[1:]):
            _flash_both_ways(q[None, :, start:end], k[None, :, start:end], v[None, :, start:end])

    return _timed(work)


def main(repeats: int = 3) -> None:
    workload = Workload()
    _, arrival = workload.arrival_steps()
    for index, (step, grouped_steps) in enumerate(zip(arrival, workload.grouped_rounds())):
        lengths = [len(doc) for doc in step]
        grouped_lengths = [[len(doc) for doc in batch] for batch in grouped_steps]
        per_8k = 8192 * 1e3 / sum(lengths)
        grouped_per_8k = 8192 * 1e3 / sum(map(sum, grouped_lengths))
        figures = {
            "packed": [packed(lengths) * per_8k for _ in range(repeats)],
            "grouped": [grouped(grouped_lengths) * grouped_per_8k for _ in range(repeats)],
            "kernels": [kernels(lengths) * per_8k for _ in range(repeats)],
            "bucketed": [bucketed(lengths) * per_8k for _ in range(repeats)],
            "heads_first": [heads_first(lengths) * per_8k for _ in range(repeats)],
        }
        medians = {name: statistics.median(values) for name, values in figures.items()}
        print(f"round {index} ({len(lengths)} documents, longest {max(lengths)}): " + ", ".join(
            f"{name} {ms:.0f} ms" for name, ms in medians.items()
        ) + f"; packed / grouped time {medians['packed'] / medians['grouped']:.2f}")


if __name__ == "__main__":
    main()
