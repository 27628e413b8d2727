"""The results folder: one appended history table of every run, and the latest run of each kind.

``benchmarks/results/history.csv`` gets one row per family and mode of every run a benchmark writes (date, commit,
machine, torch, transformers, tokens/s, the paired ratio against stock grouped eager, the bars that mode decides).
Of the JSON / MD / PNG files only the latest run of each kind stays in the folder (``cpu-<date>``, ``cpu-real-<date>``,
``long-rows-cpu-<date>``, ``ops-cpu-<date>``): :func:`keep_latest` removes the older ones when a run is written; git
keeps them.

    python -m benchmarks history benchmarks/results/*.json      # append these runs' rows (e.g. after a merge)

Standard library only: the benchmark's entry point imports it before any extra is checked.
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
COLUMNS = ("date", "commit", "kind", "machine", "cores", "torch", "transformers", "family", "mode", "tokens_per_s",
           "vs_stock_grouped_eager", "compile_s", "bars", "file")
# a result file's stem: its kind, then the date it was written (and an optional time or label)
_STEM = re.compile(r"^(?P<kind>[a-z0-9_-]*?)-(?P<date>\d{4}-\d{2}-\d{2})(?P<rest>.*)$")
_WRITTEN = (".json", ".md", ".png")


def kind_of(stem: str) -> str | None:
    """``cpu-2026-12-02-0642`` -> ``cpu``; ``long-rows-cpu-2026-12-01`` -> ``long-rows-cpu``; None if undated."""
    match = _STEM.match(stem)
    return match.group("kind") if match else None


def rows(report: dict, file: str = "", commit: str | None = None) -> list[dict]:
    """The history rows of one training-benchmark report (``results`` and ``bars``), one per family and mode."""
    kind = kind_of(pathlib.Path(file).stem) if file else None
    settings = report.get("settings") or {}
    machine = report.get("device_name") or report.get("device") or ""
    out = []
    for result in report.get("results") or []:
        decided = [bar for bar in report.get("bars") or []
                   if bar["family"] == result["family"] and bar.get("detail", "").startswith(result["mode"] + " ")]
        out.append({
            "date": report.get("date", ""), "commit": commit if commit is not None else _commit(),
            "kind": kind or settings.get("widths") or "", "machine": machine, "cores": report.get("cores", ""),
            "torch": report.get("torch", ""), "transformers": report.get("transformers", ""),
            "family": result["family"], "mode": result["mode"], "tokens_per_s": _number(result.get("tokens_per_s")),
            "vs_stock_grouped_eager": _number((result.get("ratios") or {}).get("stock_grouped_eager")),
            "compile_s": _number(result.get("compile_s")),
            "bars": "; ".join(f"{bar['bar']}: {bar['status']} {bar['value']}" for bar in decided),
            "file": pathlib.Path(file).name,
        })
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
    parser.add_argument("files", nargs="+", help="training-benchmark result JSON files, oldest first")
    parser.add_argument("--history", default=str(RESULTS / HISTORY), help="the table (default: results/history.csv)")
    parser.add_argument("--commit", default=None, help="the commit the runs were made at (default: the checkout's)")
    args = parser.parse_args(argv)
    for file in args.files:
        report = json.loads(pathlib.Path(file).read_text())
        count = append(report, pathlib.Path(args.history), file, args.commit)
        print(f"{file}: {count} rows")
    return 0
