"""The checkout's tools beside the benchmark (tools/): the docs tables they print, run as a reader would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_command_prints_the_table_without_a_runner_warning():
    """The imbalance table of docs/context-parallel-evidence.md comes from ``python -m tools.probes.balance`` (it was
    ``python -m compilepack.distributed.balance``, a module its own package imports first: Python's module runner
    warned on every run)."""
    done = subprocess.run([sys.executable, "-m", "tools.probes.balance"], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    assert "RuntimeWarning" not in done.stderr and done.stderr == "", done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 12 and rows[0].startswith("| 2 | 4096 | 49152 |")


def test_the_models_doc_generator_runs_as_a_script_from_tools():
    done = subprocess.run([sys.executable, "tools/models_doc.py", "--help"], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    assert done.stdout.startswith("usage: python tools/models_doc.py") and "--write" in done.stdout


def test_only_the_benchmarks_tests_import_the_benchmark():
    """The library's tests stand alone: only tests/benchmarks/ imports benchmarks/ or tools/."""
    imports = re.compile(r"^\s*(from|import)\s+(benchmarks|tools)\b", re.M)
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("*.py")
                 if "benchmarks" not in path.relative_to(ROOT / "tests").parts and imports.search(path.read_text())]
    assert offenders == []
