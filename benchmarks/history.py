"""The results folder: one appended history table of every run, and the latest run of each kind.

``benchmarks/results/history.csv`` gets rows from every run a benchmark writes (date, commit, machine, torch,
transformers, tokens/s, the ratio against stock grouped eager, the bars that row decides):

- the training benchmark (kind ``cpu``, ``cpu-real``): one row per family and mode; ``tokens`` is the run's real
  tokens per step, ``documents`` ``mix`` (the bench's lognormal documents);
- long rows (``long-rows-cpu``, ``python -m tools.sweeps long-rows``): one row per family, documents
  (``equal <length>`` or ``mix``), row length (``tokens``) and mode; the ratio is the point's paired one, patched
  over stock grouped, on equal documents;
- the op benchmark (``ops-cpu``): the op as the family, the implementation as the mode (``stock`` on the packed
  row, ``packed``, and ``stock_batched``: stock on the ``[n_docs, L]`` batch of equal documents, what a
  length-grouped batch is at best, which stands for stock grouped in the ratio column); forward+backward figures,
  ``tokens`` the row's length.

:func:`write` writes a run's JSON / MD / PNG files (every benchmark's, and the cost-table sweeps'); of them only
the latest run of each kind stays in the folder (``cpu-<date>``, ``cpu-real-<date>``, ``long-rows-cpu-<date>``,
``ops-cpu-<date>``): :func:`keep_latest` removes the older ones when a run is written; git keeps them.

    python -m benchmarks history benchmarks/results/*.json      # append these runs' rows (e.g. after a merge)

Standard library only at import: the benchmark's entry point imports it before any extra is checked.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import re
import subprocess

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
HISTORY = "history.csv"
COLUMNS = ("date", "commit", "kind", "machine", "cores", "torch", "transformers", "family", "mode", "tokens",
           "documents", "tokens_per_s", "vs_stock_grouped_eager", "compile_s", "bars", "file")
# a result file's stem: its kind, then the date it was written (and an optional time or label)
_STEM = re.compile(r"^(?P<kind>[a-z0-9_-]*?)-(?P<date>\d{4}-\d{2}-\d{2})(?P<rest>.*)$")
_WRITTEN = (".json", ".md", ".png")
# the op benchmark's implementations (benchmarks/ops): stock and packed on the packed row, stock on the batch
OP_STOCK, OP_PACKED, OP_STOCK_BATCHED = "stock", "packed", "stock_batched"


def kind_of(stem: str) -> str | None:
    """``cpu-2026-12-02-0642`` -> ``cpu``; ``long-rows-cpu-2026-12-01`` -> ``long-rows-cpu``; None if undated."""
    match = _STEM.match(stem)
    return match.group("kind") if match else None


def rows(report: dict, file: str = "", commit: str | None = None) -> list[dict]:
    """The history rows of one report, whichever benchmark wrote it (training, long rows or ops)."""
    if "points" in report:
        figures, kind = _long_rows_figures(report), "long-rows"
    elif any("op" in result for result in report.get("results") or []):
        figures, kind = _op_figures(report), "ops"
    else:
        figures, kind = _training_figures(report), (report.get("settings") or {}).get("widths") or ""
    common = {
        "date": report.get("date", ""), "commit": commit if commit is not None else _commit(),
        "kind": (kind_of(pathlib.Path(file).stem) if file else None) or kind,
        "machine": report.get("device_name") or report.get("device") or "", "cores": report.get("cores", ""),
        "torch": report.get("torch", ""), "transformers": report.get("transformers", ""),
        "file": pathlib.Path(file).name,
    }
    return [{**common, **row} for row in figures]


def _training_figures(report: dict) -> list[dict]:
    """One row per family and mode; the bars a mode's row decides are those it is the numerator of."""
    from .modes import STOCK_GROUPED_EAGER

    tokens = (report.get("settings") or {}).get("tokens_per_step", "")
    out = []
    for result in report.get("results") or []:
        decided = [bar for bar in report.get("bars") or []
                   if bar["family"] == result["family"] and bar.get("detail", "").startswith(result["mode"] + " ")]
        out.append({
            "family": result["family"], "mode": result["mode"], "tokens": tokens, "documents": "mix",
            "tokens_per_s": _number(result.get("tokens_per_s")),
            "vs_stock_grouped_eager": _number((result.get("speedup_vs") or {}).get(STOCK_GROUPED_EAGER)),
            "compile_s": _number(result.get("compile_s")),
            "bars": "; ".join(f"{bar['bar']}: {_status(bar)} {bar['value']}" for bar in decided),
        })
    return out


def _long_rows_figures(report: dict) -> list[dict]:
    """One row per point (family, documents, row length) and mode; the point's paired ratio (its first mode over
    its second) on the patched row where the second is stock grouped eager, 1.0 on the stock grouped row."""
    from .modes import STOCK_GROUPED_EAGER

    doc_len = (report.get("settings") or {}).get("doc_len", "")
    out = []
    for point in report.get("points") or []:
        if point.get("skipped"):
            continue
        modes = list(point["modes"])
        documents = f"equal {doc_len}" if point["documents"] == "equal" else point["documents"]
        ratios = {modes[0]: point.get("speedup"), modes[-1]: 1.0} if modes[-1] == STOCK_GROUPED_EAGER else {}
        for mode, figures in point["modes"].items():
            ratio = ratios.get(mode)
            out.append({"family": point["family"], "mode": mode, "tokens": point.get("row", point["tokens"]),
                        "documents": documents, "tokens_per_s": _number(figures.get("tokens_per_s")),
                        "vs_stock_grouped_eager": _number(ratio), "compile_s": "", "bars": ""})
    return out


def _op_figures(report: dict) -> list[dict]:
    """Per op, forward+backward: stock and packed on the packed row of random-length documents, then (where the run
    has it) stock on the batch of equal documents and packed on their row; tokens/s = the row's tokens over the
    median time; the ratio column is packed over stock batched (the per-repeat median the op benchmark reports)."""
    settings = report.get("settings") or {}
    tokens, n_docs = settings.get("T", ""), settings.get("n_docs", "")
    out = []
    for result in report.get("results") or []:
        row = {"family": result["op"], "tokens": tokens, "compile_s": "", "bars": ""}
        packed_row = result.get("fwd+bwd") or {}
        batched = (result.get("batched") or {}).get("fwd+bwd") or {}
        for mode, documents, timing, key, ratio in (
                (OP_STOCK, f"{n_docs} random-length", packed_row, "stock_ms", None),
                (OP_PACKED, f"{n_docs} random-length", packed_row, "packed_ms", None),
                (OP_STOCK_BATCHED, f"{n_docs} equal-length", batched, "stock_ms", 1.0),
                (OP_PACKED, f"{n_docs} equal-length", batched, "packed_ms", batched.get("speedup"))):
            if timing.get(key):
                out.append({**row, "mode": mode, "documents": documents,
                            "tokens_per_s": _number(tokens * 1e3 / timing[key] if tokens else None),
                            "vs_stock_grouped_eager": _number(ratio)})
    return out


def append(report: dict, path: pathlib.Path, file: str = "", commit: str | None = None) -> int:
    """Append one report's rows to the history table at ``path`` (created with its header); returns the count."""
    new = rows(report, file, commit)
    exists = path.exists()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        if not exists:
            writer.writeheader()
        writer.writerows(new)
    return len(new)


def keep_latest(folder: pathlib.Path, stem: str) -> list[str]:
    """Remove the files of older runs of ``stem``'s kind from ``folder`` (git keeps them); returns their names."""
    kind = kind_of(stem)
    if kind is None:
        return []
    removed = []
    for path in sorted(folder.iterdir()):
        if path.suffix in _WRITTEN and path.stem != stem and kind_of(path.stem) == kind and path.stem < stem:
            path.unlink()
            removed.append(path.name)
    return removed


def record(report: dict, out: pathlib.Path, stem: str) -> str:
    """What every benchmark does once its run is written as ``out/<stem>.*``: append the run's rows to
    ``out/history.csv`` and remove the older runs of its kind from ``out``; returns a line saying so."""
    appended = append(report, out / HISTORY, f"{stem}.json")
    removed = keep_latest(out, stem)
    return f"appended {appended} rows to {out / HISTORY}" + (f"; removed the older {', '.join(removed)}"
                                                           if removed else "")


def write(report: dict, out: pathlib.Path, stem: str, markdown, plot=None, history: bool = False, show=None,
          no_plot: str = "") -> None:
    """``out/<stem>.json``, ``.md`` and (with ``plot``) ``.png``; the run shown (``show``, else its table printed);
    with ``history`` the run's rows appended to the history table; older runs of its kind removed from ``out`` (the
    folder keeps the latest). ``no_plot``: what the last line says where no plot was drawn. Every benchmark's
    writer: the training run, the op benchmark and the cost-table sweeps (``tools/sweeps``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    if plot is not None:
        plot(report, out / f"{stem}.png")
    show(report) if show else print(markdown(report))
    print(f"wrote {out / stem}.json, .md" + (", .png" if plot is not None else no_plot))
    if history:
        print(record(report, out, stem))
    elif removed := keep_latest(out, stem):
        print(f"removed the older {', '.join(removed)}")


def _status(bar: dict) -> str:
    """The bar's status; reports older than the status field have only ``met`` (True, False or None)."""
    return bar.get("status") or {True: "met", False: "missed"}.get(bar.get("met"), "n/a")


def _number(value):
    return "" if value is None else round(float(value), 3)


def _commit() -> str:
    """The checkout's commit, with ``+`` when it has uncommitted changes ("" outside a git checkout)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=RESULTS.parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=RESULTS.parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return commit + ("+" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks history", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="result JSON files (training, long rows, ops), oldest first")
    parser.add_argument("--history", default=str(RESULTS / HISTORY), help="the table (default: results/history.csv)")
    parser.add_argument("--commit", default=None, help="the commit the runs were made at (default: the checkout's)")
    args = parser.parse_args(argv)
    for file in args.files:
        report = json.loads(pathlib.Path(file).read_text())
        count = append(report, pathlib.Path(args.history), file, args.commit)
        print(f"{file}: {count} rows")
    return 0
