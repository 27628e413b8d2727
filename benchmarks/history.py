"""The results folder: ``history.csv``, one row per family and mode of every run (its older rows also hold the
long-row sweeps and op benchmarks of earlier commits), and the latest run of each kind (git keeps the older).
"""

from __future__ import annotations

import csv
import json
import pathlib
import re
import subprocess

from .modes import STOCK_GROUPED_EAGER

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
HISTORY = "history.csv"
COLUMNS = ("date", "commit", "kind", "machine", "cores", "torch", "transformers", "family", "mode", "tokens",
           "documents", "tokens_per_s", "vs_stock_grouped_eager", "compile_s", "bars", "file")
# a result file's stem: its kind, then the date it was written (and an optional time or label)
_STEM = re.compile(r"^(?P<kind>[a-z0-9_-]*?)-(?P<date>\d{4}-\d{2}-\d{2})(?P<rest>.*)$")
_WRITTEN = (".json", ".md", ".png")


def kind_of(stem: str) -> str | None:
    """``cpu-2026-12-02-0642`` -> ``cpu``; ``long-rows-cpu-2026-12-01`` -> ``long-rows-cpu``; None if undated."""
    match = _STEM.match(stem)
    return match.group("kind") if match else None


def rows(report: dict, file: str = "", commit: str | None = None) -> list[dict]:
    """The history rows of one training run: one per family and mode; the bars a mode's row decides are those it
    is the numerator of."""
    common = {
        "date": report.get("date", ""), "commit": commit if commit is not None else _commit(),
        "kind": (kind_of(pathlib.Path(file).stem) if file else None) or report["settings"].get("widths", ""),
        "machine": report.get("device_name") or report.get("device") or "", "cores": report.get("cores", ""),
        "torch": report.get("torch", ""), "transformers": report.get("transformers", ""),
        "file": pathlib.Path(file).name,
    }
    out = []
    for result in report.get("results") or []:
        decided = [bar for bar in report.get("bars") or []
                   if bar["family"] == result["family"] and bar.get("detail", "").startswith(result["mode"] + " ")]
        out.append({
            **common, "family": result["family"], "mode": result["mode"],
            "tokens": report["settings"].get("tokens_per_step", ""), "documents": "mix",
            "tokens_per_s": _number(result.get("tokens_per_s")),
            "vs_stock_grouped_eager": _number((result.get("speedup_vs") or {}).get(STOCK_GROUPED_EAGER)),
            "compile_s": _number(result.get("compile_s")),
            "bars": "; ".join(f"{bar['bar']}: {bar['status']} {bar['value']}" for bar in decided),
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


def write(report: dict, out: pathlib.Path, stem: str, markdown, plot=None, show=None, no_plot: str = "") -> None:
    """``out/<stem>.json``, ``.md`` and (with ``plot``) ``.png``; the run shown; its rows appended to the history
    table; the older runs of its kind removed from ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    if plot is not None:
        plot(report, out / f"{stem}.png")
    show(report)
    print(f"wrote {out / stem}.json, .md" + (", .png" if plot is not None else no_plot))
    appended = append(report, out / HISTORY, f"{stem}.json")
    removed = keep_latest(out, stem)
    print(f"appended {appended} rows to {out / HISTORY}" + (f"; removed the older {', '.join(removed)}"
                                                          if removed else ""))


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
