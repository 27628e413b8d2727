"""Op-level benchmark: each stock transformers function vs compilepack's op, on the same packed tokens.

    python -m benchmarks ops                 # every op module of this package, CPU
    python -m benchmarks ops --ops attention,causal_conv1d --T 4096 --n-docs 32

A module of this package exposes ``NAME`` and ``setup(T, n_docs, device, seed, equal_lengths=False)`` returning
``{"stock": fn, "packed": fn, "inputs": [tensors requiring grad]}``; both functions return one tensor. Stock runs
on the packed row as transformers would (ignoring boundaries, except attention, whose stock path builds a dense
mask), so its figure is a cost baseline, not a correct alternative. With ``equal_lengths=True`` the row holds
``n_docs`` documents of ``T / n_docs`` tokens and the case also has ``"batched"``: the stock function on the
``[n_docs, L]`` batch of the same tokens, correct and without padding, the best a length-grouped padded batch can
do (its output, through ``"batched_as_packed"`` where the layouts differ, must equal packed's). Forward and
forward+backward are timed with the two sides alternating, so load from other processes hits both alike; a figure
is the median over repeats after warm-up, the ratio the median of per-repeat ratios. Writes
``ops-<device>-<date>.json`` and ``.md``, appends the run to the history table (the op as the family, ``stock``,
``packed`` and ``stock_batched`` as the modes) and removes the older op runs from the output folder.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import pathlib
import pkgutil
import statistics
import sys

import torch

from ..history import RESULTS, write
from ..markdown import cell
from ..measure import synchronizer
from ._common import alternating_ms


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    _quiet_transformers()
    rows = [_bench_op(module, args) for module in op_modules(args.ops)]
    stem = f"ops-{args.device.split(':')[0]}-{datetime.date.today().isoformat()}"
    # the history gets the op as the family, each implementation as a mode
    write(_report(args, rows), pathlib.Path(args.out), stem, markdown, history=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ops", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="all", help="comma-separated op modules (default: all)")
    parser.add_argument("--T", type=int, default=2048, help="tokens in the packed row (default: 2048)")
    parser.add_argument("--n-docs", type=int, default=16, help="documents in the row (default: 16)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per function (default: 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repeats first (default: 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--out", default=str(RESULTS), help="output directory (default: benchmarks/results)")
    parser.add_argument("--no-batched", dest="batched", action="store_false",
                        help="skip the second comparison: packed vs stock on the batch of equal-length documents")
    return parser


def op_modules(selection: str = "all") -> list:
    """The op modules of this package (exposing NAME and setup), in name order (or the selected ones)."""
    package = sys.modules[__name__]

    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_"))
    if selection != "all":
        wanted = [name.strip() for name in selection.split(",") if name.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"no op module {unknown} in {__name__}; available: {', '.join(names)}")
        names = wanted
    modules = [importlib.import_module(f"{package.__name__}.{name}") for name in names]
    return [m for m in modules if hasattr(m, "NAME") and hasattr(m, "setup")]


# ------------------------------------------------------------------------------------------------ timing


def _bench_op(module, args) -> dict:
    row = {"op": module.NAME, "T": args.T, "n_docs": args.n_docs, "error": None}
    try:
        case = module.setup(T=args.T, n_docs=args.n_docs, device=args.device, seed=args.seed)
        sync = synchronizer(torch.device(args.device))
        row.update(_timed_passes(case, sync, args))
        row["max_abs_diff"] = _max_abs_diff(case)
        if args.batched:
            row["batched"] = _batched_row(module, args, sync)
    except Exception as error:  # one op failing must not hide the others
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    print(_one_line(row), flush=True)
    return row


def _timed_passes(case: dict, sync, args) -> dict:
    """Forward and forward+backward figures of ``case["stock"]`` vs ``case["packed"]``."""
    grads = _output_grads(case, args.seed)
    return {pass_name: _alternating(case, grads, run, sync, args.warmup, args.repeats)
            for pass_name, run in (("fwd", _forward), ("fwd+bwd", _forward_backward))}


def _batched_row(module, args, sync) -> dict:
    """Packed vs the stock function on the batch of ``n_docs`` equal-length documents (the same tokens)."""
    case = module.setup(T=args.T, n_docs=args.n_docs, device=args.device, seed=args.seed, equal_lengths=True)
    as_packed = case.get("batched_as_packed", lambda out: out)
    versus_batched = {**case, "stock": case["batched"]}
    row = _timed_passes(versus_batched, sync, args)
    row["max_abs_diff"] = _max_abs_diff({"stock": lambda: as_packed(case["batched"]()), "packed": case["packed"]})
    return row


def _output_grads(case: dict, seed: int) -> dict:
    """A fixed random output gradient per function (their outputs may differ in layout)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        shapes = {name: case[name]() for name in ("stock", "packed")}
    return {name: torch.randn(out.shape, generator=generator).to(out) for name, out in shapes.items()}


def _forward(case, name, grads):
    with torch.no_grad():
        case[name]()


def _forward_backward(case, name, grads):
    for tensor in case["inputs"]:
        tensor.grad = None
    case[name]().backward(grads[name])


def _alternating(case, grads, run, sync, warmup: int, repeats: int) -> dict:
    times = alternating_ms(lambda name: run(case, name, grads), warmup, repeats, sync=sync)
    stock_ms, packed_ms = statistics.median(times["stock"]), statistics.median(times["packed"])
    return {
        "stock_ms": round(stock_ms, 3),
        "packed_ms": round(packed_ms, 3),
        "speedup": round(statistics.median(s / p for s, p in zip(times["stock"], times["packed"])), 3),
    }


def _max_abs_diff(case: dict) -> float | None:
    """|stock - packed| when the outputs line up element for element (informative: stock ignores boundaries)."""
    with torch.no_grad():
        stock, packed = case["stock"](), case["packed"]()
    if stock.numel() != packed.numel():
        return None
    return float((stock.reshape(packed.shape).float() - packed.float()).abs().max())


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()  # stock functions warn once that their CUDA kernels are missing


# ------------------------------------------------------------------------------------------------ report


def _report(args, rows: list[dict]) -> dict:
    import transformers

    return {
        "device": args.device.split(":")[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "settings": {"T": args.T, "n_docs": args.n_docs, "repeats": args.repeats, "warmup": args.warmup,
                     "seed": args.seed, "batched": args.batched},
        "results": rows,
    }


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"# Op benchmark: {report['device']}, {report['date']}",
        "",
        f"torch {report['torch']}, transformers {report['transformers']}, {report['threads']} threads; one packed "
        f"row of T={settings['T']} tokens, {settings['n_docs']} documents; median of {settings['repeats']} repeats "
        f"after {settings['warmup']} warm-up; speedup = stock time / packed time (median of per-repeat ratios).",
        "",
        "| op | fwd stock ms | fwd packed ms | fwd speedup | fwd+bwd stock ms | fwd+bwd packed ms | fwd+bwd speedup "
        "| max abs diff | error |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for row in report["results"]:
        cells = [row["op"], *_comparison_cells(row), row.get("error") or ""]
        lines.append("| " + " | ".join(cells) + " |")
    if settings.get("batched"):
        lines += _batched_table(report)
    return "\n".join(lines) + "\n"


def _batched_table(report: dict) -> list[str]:
    settings = report["settings"]
    length = settings["T"] // settings["n_docs"]
    lines = [
        "",
        f"The same tokens as {settings['n_docs']} documents of {length}: packed vs the stock function on their "
        f"`[{settings['n_docs']}, {length}]` batch (correct, no padding: the best a length-grouped padded batch can "
        "do); speedup = stock batched time / packed time; max abs diff = |stock batched - packed| (both correct).",
        "",
        "| op | fwd batched ms | fwd packed ms | fwd speedup | fwd+bwd batched ms | fwd+bwd packed ms | "
        "fwd+bwd speedup | max abs diff |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in report["results"]:
        lines.append("| " + " | ".join([row["op"], *_comparison_cells(row.get("batched") or {})]) + " |")
    return lines


def _comparison_cells(figures: dict) -> list[str]:
    """One comparison's table cells: stock ms, packed ms and speedup for fwd, then fwd+bwd, then max abs diff."""
    cells = []
    for pass_name in ("fwd", "fwd+bwd"):
        timing = figures.get(pass_name) or {}
        cells += [cell(timing.get("stock_ms"), "{:.2f}"), cell(timing.get("packed_ms"), "{:.2f}"),
                  cell(timing.get("speedup"), "{:.2f}x")]
    return [*cells, cell(figures.get("max_abs_diff"), "{:.1e}")]


def _one_line(row: dict) -> str:
    if row["error"]:
        return f"{row['op']:>18}: error {row['error']}"
    fwd, both = row["fwd"], row["fwd+bwd"]
    return (f"{row['op']:>18}: fwd {fwd['stock_ms']:.2f} -> {fwd['packed_ms']:.2f} ms ({fwd['speedup']:.2f}x), "
            f"fwd+bwd {both['stock_ms']:.2f} -> {both['packed_ms']:.2f} ms ({both['speedup']:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
