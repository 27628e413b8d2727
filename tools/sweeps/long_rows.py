"""``python -m tools.sweeps long-rows``: how a training step's cost grows with the tokens per row.

For each family and each row length ``T`` (tokens per step), the same documents three ways:

- **equal documents** (``T / doc_len`` documents of ``doc_len`` tokens): patched packed (one ``[1, T]`` row) against
  stock grouped (the ``[T / doc_len, doc_len]`` batch: no padding at all, the best a length-grouped batch can do);
- **the bench's length mix** (the first ``T`` real tokens of the training bench's lognormal documents in arrival
  order): patched packed against stock padded (right-padded to the longest document, as HF Trainer pads), up to
  ``--padded-max`` tokens (stock padded computes ~5x the real tokens: its memory outgrows the machine first).

Each comparison runs as the training bench's workers do (``rounds``): one warm worker process per mode, timed rounds
taken in turn, so the ratio of two modes in the same round is paired, and each worker's peak memory is its own.
Writes ``long-rows-<device>-<date>.json``, ``.md`` and ``.png`` (tokens/s and peak memory against T, log x).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

from benchmarks.measure import load_average

from . import sweep

ROWS = (4096, 16384, 65536)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import dependencies

    args = _parser().parse_args(argv)
    can_plot = dependencies.check(plot=not args.no_plot)
    if args.replot:
        return _replot(pathlib.Path(args.replot), can_plot)
    started, load_start = time.monotonic(), load_average()
    points = []
    for family in args.model.split(","):
        for tokens in sweep.numbers(args.rows):
            points += _measure_point(args, family.strip(), tokens)
            print(_point_line(points[-2:]), flush=True)
    report = sweep.report_of(args, started, load_start, points=points)
    allocator = "" if args.allocator == "keep" else f"{args.allocator}-"
    write(report, pathlib.Path(args.out), f"long-rows-cpu-{allocator}{sweep.today()}", can_plot)
    return 0


def write(report: dict, out: pathlib.Path, stem: str, can_plot: bool = True) -> None:
    """The sweep's JSON, markdown and plot; its rows appended to the history table; older sweeps of its kind
    removed from ``out``."""
    sweep.write(report, out, stem, markdown, plot if can_plot else None, history=True)


def _parser():
    parser = sweep.parser("long-rows", __doc__, families=("qwen3_5",), rows=ROWS, family_option="--model")
    parser.add_argument("--doc-len", type=int, default=256, help="tokens per equal document (default: 256)")
    parser.add_argument("--padded-max", type=int, default=16384,
                        help="largest row stock padded runs on (default: 16384; ~5x the tokens in padding)")
    parser.add_argument("--steps", type=int, default=2, help="timed rounds per mode and point (default: 2)")
    parser.add_argument("--widths", choices=("bench", "real"), default="bench", help="model widths (default: bench)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    parser.add_argument("--allocator", choices=("keep", "system"), default="keep",
                        help="keep: freed memory stays in each worker for reuse (as on a GPU); system: glibc's "
                             "defaults, which page-fault every block over 32 MB at every step (default: keep)")
    parser.add_argument("--step-timeout", type=float, default=900.0, help="seconds per timed round at most")
    parser.add_argument("--replot", metavar="JSON", help="only rewrite the .md and .png of a saved run's JSON")
    return parser


def _replot(path: pathlib.Path, can_plot: bool) -> int:
    report = json.loads(path.read_text())
    path.with_suffix(".md").write_text(markdown(report))
    if can_plot:
        plot(report, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.md')}" + (", .png" if can_plot else ""))
    return 0


def equal_documents(tokens: int, doc_len: int) -> list[list[int]]:
    """``tokens // doc_len`` documents of ``doc_len`` tokens from the bench's corpus."""
    from benchmarks import data

    if tokens % doc_len:
        raise SystemExit(f"--rows: {tokens} is not a multiple of --doc-len {doc_len}")
    return data.documents([doc_len] * (tokens // doc_len), seed=0)


def mixed_documents(tokens: int) -> list[list[int]]:
    """The bench's lognormal documents in arrival order, the first ``tokens`` real tokens at most."""
    from benchmarks import data

    lengths, seed = [], 0
    while sum(lengths) < 2 * tokens:
        lengths += data.LengthMix().sample(256, seed)
        seed += 1
    return data.steps_by_token_budget(data.documents(lengths, 0), tokens)[0]


def _measure_point(args, family: str, tokens: int) -> list[dict]:
    from benchmarks.modes import PATCHED_PACKED_EAGER, STOCK_GROUPED_EAGER, STOCK_PADDED_EAGER

    # patched first: a point's ratio is patched over stock
    equal = _compare(args, family, tokens, "equal", (PATCHED_PACKED_EAGER, STOCK_GROUPED_EAGER),
                     equal_documents(tokens, args.doc_len))
    points = [equal]
    if tokens <= args.padded_max:
        points.append(_compare(args, family, tokens, "mix", (PATCHED_PACKED_EAGER, STOCK_PADDED_EAGER),
                               mixed_documents(tokens)))
    else:
        points.append({"family": family, "tokens": tokens, "documents": "mix", "skipped":
                       f"stock padded above --padded-max {args.padded_max} tokens"})
    return points


def _compare(args, family: str, tokens: int, documents: str, modes: tuple[str, ...], step) -> dict:
    """One point: the modes' workers on the same documents, rounds taken in turn."""
    from benchmarks.bars import paired_ratios
    from benchmarks.isolation import ProcessContext
    from benchmarks.modes import Workload
    from benchmarks.rounds import run_family
    from benchmarks.worker import ModeSpec
    from compilepack.patching import family_named

    workload = Workload(tokens_per_step=tokens, steps=args.steps)
    context = ProcessContext(preload=[family_named(family).modeling])
    workers = {mode: context.worker(ModeSpec(family=family, mode=mode, workload=workload, threads=args.threads,
                                             widths=args.widths, step=tuple(tuple(doc) for doc in step),
                                             allocator=args.allocator))
               for mode in modes}
    results = run_family(workers, args.steps, warmup_timeout_s=args.step_timeout, step_timeout_s=args.step_timeout)
    figures = {r["mode"]: {k: r.get(k) for k in ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max",
                                                   "peak_mem_mb", "padding_frac", "max_logit_diff", "error")}
               for r in results}
    ratios = paired_ratios(results[0], results[1]) if all(r.get("tokens_per_s") for r in results) else []
    lengths = [len(doc) for doc in step]
    return {"family": family, "tokens": sum(lengths), "row": tokens, "documents": documents,
            "n_docs": len(lengths), "median_len": statistics.median(lengths), "modes": figures,
            "speedup": round(statistics.median(ratios), 3) if ratios else None,
            "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
            "ratios": [round(r, 3) for r in ratios], "load_avg": load_average()}


# ------------------------------------------------------------------------------------------------ outputs


def _point_line(points: list[dict]) -> str:
    parts = []
    for p in points:
        if p.get("skipped"):
            parts.append(f"{p['documents']}: skipped")
            continue
        cells = ", ".join(f"{mode} {f['tokens_per_s'] or 0:.0f} tok/s {f['peak_mem_mb'] or 0:.0f} MB"
                          for mode, f in p["modes"].items())
        parts.append(f"{p['documents']}: {cells}, ratio {p['speedup']}")
    return f"{points[0]['family']} T={points[0]['row']}: " + "; ".join(parts)


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [f"# compilepack long rows: cpu, {report['date']}", "",
             (f"torch {report['torch']}, transformers {report['transformers']}; {settings['widths']} widths; "
              f"{settings['steps']} timed rounds per mode and point, taken in turn across the point's two warm "
              f"workers; allocator `{settings.get('allocator', 'system')}`; threads {settings['threads'] or 'torch default'}; run wall time {report['wall_s']:.0f} s; "
              f"1-minute load average {report['load_avg']['start']} at the start, {report['load_avg']['end']} at "
              "the end, per point in the JSON."), "",
             ("`equal`: documents of "
              f"{settings['doc_len']} tokens, patched packed `[1, T]` vs stock grouped `[T/{settings['doc_len']}, "
              f"{settings['doc_len']}]` (no padding: stock's best case). `mix`: the training bench's lognormal "
              "documents in arrival order, patched packed vs stock padded to the longest document. Tokens/s: median "
              "[min-max] over rounds; ratio: patched over stock, paired per round, median [min-max]."), "",
             "| family | T | documents | n docs | patched tok/s | stock tok/s | ratio | patched peak MB | stock peak MB | stock padding |",
             "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
    for p in report["points"]:
        if p.get("skipped"):
            lines.append(f"| {p['family']} | {p['tokens']} | {p['documents']} | - | - | - | - | - | - | {p['skipped']} |")
            continue
        patched, stock = list(p["modes"].values())
        ratio = "-" if p["speedup"] is None else f"{p['speedup']:.2f} [{p['speedup_range'][0]:.2f}-{p['speedup_range'][1]:.2f}]"
        lines.append(f"| {p['family']} | {p['tokens']} | {p['documents']} | {p['n_docs']} | {_tps(patched)} | "
                     f"{_tps(stock)} | {ratio} | {_mb(patched)} | {_mb(stock)} | "
                     f"{(stock.get('padding_frac') or 0):.0%} |")
    return "\n".join(lines) + "\n"


def _tps(f: dict) -> str:
    if not f.get("tokens_per_s"):
        return f"- ({(f.get('error') or '')[:60]})"
    return f"{f['tokens_per_s']:.0f} [{f['tokens_per_s_min']:.0f}-{f['tokens_per_s_max']:.0f}]"


def _mb(f: dict) -> str:
    return "-" if f.get("peak_mem_mb") is None else f"{f['peak_mem_mb']:.0f}"


def plot(report: dict, path: pathlib.Path) -> None:
    """Three panels against tokens per row (log x): tokens/s (whiskers: min-max of the rounds), patched over stock
    paired per round (whiskers their range; 1 = parity) and peak memory."""
    speed, memory, ratio, styles = {}, {}, {}, {}
    for p in report["points"]:
        style = "-" if p["documents"] == "equal" else "--"
        for mode, f in (p.get("modes") or {}).items():
            if f.get("tokens_per_s"):
                label = f"{p['family']} {mode} ({p['documents']})"
                styles[label] = style
                speed.setdefault(label, []).append((p["tokens"], f["tokens_per_s"], f["tokens_per_s_min"],
                                                    f["tokens_per_s_max"]))
                memory.setdefault(label, []).append((p["tokens"], f["peak_mem_mb"]))
        if p.get("speedup"):
            stock = "grouped" if p["documents"] == "equal" else "padded"
            label = f"{p['family']}: patched / stock {stock} ({p['documents']})"
            styles[label] = style
            ratio.setdefault(label, []).append((p["tokens"], p["speedup"], *p["speedup_range"]))
    sweep.panels(path, f"compilepack long rows, cpu, {report['date']} ({report['settings']['widths']} widths)", [
        {"series": speed, "styles": styles, "ylabel": "real tokens / s (training step)", "logy": True},
        {"series": ratio, "styles": styles, "ylabel": "patched / stock tokens/s (paired rounds)", "hline": 1.0},
        {"series": memory, "styles": styles, "ylabel": "peak memory, MB (RSS above baseline)", "logy": True},
    ], size=(16, 4.8))


if __name__ == "__main__":
    raise SystemExit(main())
