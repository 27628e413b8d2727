"""The default run's modes of one family in one process, their rounds interleaved: the paired ratios without the
hand-over between the bench's worker processes, and (``--profile``) where each mode's step goes.

The bench (``python -m benchmarks``) gives every mode its own process, as a user's training run is one,
and pairs rounds in time. This script builds the chosen modes side by side in one process, with the bench's own
models, batches, allocator setting (``keep``) and compile call, warms each up on its round 0, then runs rounds 1 to
``--steps - 1`` of the default workload mode after mode, ``--repeats`` times, the mode order turning each repeat.
It prints each mode's tokens/s per round, and each mode's per-round ratio to the first mode named.

Run (about 2 minutes on 2 cores for Llama; the compiles take most of it)::

    python -m tools.probes.one_process --model llama \
        --modes stock_grouped_eager,patched_packed_compiled,patched_packed_eager --profile

Its figures so far are in benchmarks/notes/notes-2026-12-01.md ("Late evening") and notes-2026-12-02.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import compilepack
from benchmarks import measure
from benchmarks.modes import Workload, mode_named
from benchmarks.worker import _compiled as compiled_as_the_bench_does
from benchmarks.worker import build_model
from compilepack.patching import family_named


def prepared(family: str, mode_name: str, workload: Workload):
    """``(step, rounds)``: one training step of the mode's model (forward, backward, AdamW) and its rounds."""
    mode = mode_named(mode_name)
    model = build_model(family_named(family), bench_config(family), seed=0)
    if mode.patched:
        compilepack.patch(model)
    runs = compiled_as_the_bench_does(model, mode, "inductor")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(batch) -> None:
        runs(**batch.tensors).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _warmup, rounds = mode.batches(workload)
    for batch in rounds[0]:  # the compile, and the first full-size step, out of the timed rounds
        step(batch)
    return step, rounds


def timed_round(step, batches) -> float:
    """Real tokens per second over one round's batches."""
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    return sum(batch.real_tokens for batch in batches) / (time.perf_counter() - start)


def profiled(step, batches, top: int) -> list[str]:
    """The top ops by self CPU time over one round, in ms per 8192 real tokens."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for batch in batches:
            step(batch)
    per_8k = 8192 / sum(batch.real_tokens for batch in batches) / 1e3
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) * per_8k
    return [f"  total {total:7.1f} ms / 8192 tokens"] + [
        f"  {e.key[:64]:64s} {e.self_cpu_time_total * per_8k:7.1f} ms  x{e.count}" for e in events[:top]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--modes", default="stock_grouped_eager,patched_packed_compiled,patched_packed_eager",
                        help="comma-separated bench modes; ratios are to the first")
    parser.add_argument("--steps", type=int, default=3, help="the workload's rounds (round 0 warms up)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="profile one more round per mode")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    measure.keep_freed_memory()
    workload = Workload(steps=args.steps)
    names = args.modes.split(",")
    modes = {}
    for name in names:
        started = time.perf_counter()
        modes[name] = prepared(args.model, name, workload)
        print(f"{name}: ready in {time.perf_counter() - started:.1f} s", flush=True)

    figures = {name: [] for name in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for index in range(1, args.steps):
            for name in order:
                step, rounds = modes[name]
                figures[name].append(timed_round(step, rounds[index]))

    baseline = figures[names[0]]
    for name in names:
        ratios = [mine / theirs for mine, theirs in zip(figures[name], baseline)]
        print(f"{name}: {statistics.median(figures[name]):.0f} tok/s (rounds {[round(f) for f in figures[name]]}); "
              f"x {names[0]}: {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")
    if args.profile:
        for name in names:
            step, rounds = modes[name]
            print(f"{name}, one round profiled:", *profiled(step, rounds[1], args.top), sep="\n")


if __name__ == "__main__":
    main()
