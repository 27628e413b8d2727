"""What the patched model's boundary guards cost: time per training step with and without them, eager and compiled.

    python -m tools.probes.guard_cost [--family llama] [--tokens 2048] [--docs 16] [--reps 20]

The same model and batch run with compilepack's guards as shipped and with them switched off (the guard functions
replaced by no-ops for the measurement only), alternating step by step so outside load hits both alike; the
medians and their ratio are printed. Compiled runs use inductor (``fullgraph=True, dynamic=True``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

import compilepack
from compilepack.batch import rules
from benchmarks.configs import build_bench_model
from benchmarks.data import hf_packed_batch

_GUARDS = ("check_static", "check_values_on_host", "assert_values_in_graph", "assert_seq_idx_in_graph")


@contextlib.contextmanager
def guards_off():
    saved = {name: getattr(guards, name) for name in _GUARDS}
    for name in _GUARDS:
        setattr(guards, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(guards, name, function)


def _step(model, batch):
    model(**batch).loss.backward()


def _batch(vocab: int, tokens: int, docs: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(tokens - 1, generator=generator)[: docs - 1].add(1).tolist())
    lengths = [e - s for s, e in zip([0, *cuts], [*cuts, tokens])]
    return hf_packed_batch([torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths])


def measure(family: str, tokens: int, docs: int, reps: int, compiled: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    model = compilepack.patch(build_bench_model(family)).train()
    batch = _batch(model.config.get_text_config().vocab_size, tokens, docs)
    with_guards, without = model, copy.deepcopy(model)
    if compiled:
        with_guards = torch.compile(with_guards, fullgraph=True, dynamic=True)
        with guards_off():
            without = torch.compile(without, fullgraph=True, dynamic=True)
            _step(without, batch)  # compiled without the guards
    _step(with_guards, batch)
    times = {True: [], False: []}
    for _ in range(reps):
        for guarded, runner in ((True, with_guards), (False, without)):
            with contextlib.nullcontext() if guarded else guards_off():
                start = time.perf_counter()
                _step(runner, batch)
                times[guarded].append(time.perf_counter() - start)
    return statistics.median(times[True]), statistics.median(times[False])


def prepare_cost(family: str, tokens: int, docs: int, reps: int) -> tuple[float, float]:
    """Median time of the decoder's per-forward boundary preparation alone (host checks included), with and
    without the guards: the direct cost, robust to outside load."""
    from compilepack.patching.decoder import prepare_packed_kwargs

    vocab = build_bench_model(family).config.get_text_config().vocab_size
    batch = _batch(vocab, tokens, docs)
    times = {True: [], False: []}
    for _ in range(reps * 10):
        for guarded in (True, False):
            with contextlib.nullcontext() if guarded else guards_off():
                start = time.perf_counter()
                prepare_packed_kwargs(dict(batch))
                times[guarded].append(time.perf_counter() - start)
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    guarded, unguarded = prepare_cost(args.family, args.tokens, args.docs, args.reps)
    print(f"boundary preparation per forward: {guarded * 1e6:.0f} us with guards, {unguarded * 1e6:.0f} us without")
    for compiled in (False, True):
        guarded, unguarded = measure(args.family, args.tokens, args.docs, args.reps, compiled)
        mode = "compiled" if compiled else "eager"
        print(f"{args.family} {mode}: {guarded * 1e3:.1f} ms/step with guards, {unguarded * 1e3:.1f} ms without "
              f"({(guarded / unguarded - 1) * 100:+.1f}%), median of {args.reps}, {args.tokens} tokens, {args.docs} docs")


if __name__ == "__main__":
    main()
