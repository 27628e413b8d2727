"""The checkout's tools (tools/): the models docs generator run as a reader would, and the import rules between
tools/, benchmarks/ and the tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _importers(folder: Path, names: str) -> list[str]:
    imports = re.compile(rf"^\s*(from|import)\s+({names})\b", re.M)
    return sorted(str(path.relative_to(ROOT)) for path in folder.rglob("*.py") if imports.search(path.read_text()))


def test_the_models_doc_generator_runs_as_a_script_from_tools():
    done = subprocess.run([sys.executable, "tools/models_doc.py", "--help"], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    assert done.stdout.startswith("usage: python tools/models_doc.py") and "--write" in done.stdout


def test_the_models_doc_generator_rewrites_its_block_only():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import models_doc
    finally:
        sys.path.remove(str(ROOT / "tools"))
    page = "# Title\n\n<!-- models_doc.py: families -->\nold table\n<!-- /models_doc.py -->\n\nby hand\n"
    assert models_doc.replace_block(page, "families", "new table\n") == page.replace("old table\n", "new table\n\n")
    with pytest.raises(SystemExit, match="no '<!-- models_doc.py: families -->'"):
        models_doc.replace_block(page.replace("<!-- /models_doc.py -->", ""), "families", "new")
    assert "<!-- models_doc.py: families -->" in (ROOT / "docs" / "models.md").read_text()


def test_only_the_benchmarks_tests_import_the_benchmark():
    """The library's tests stand alone: only tests/benchmarks/ imports benchmarks/ or tools/."""
    offenders = [path for path in _importers(ROOT / "tests", "benchmarks|tools")
                 if not path.startswith("tests/benchmarks/")]
    assert offenders == []


def test_tools_and_the_benchmark_never_import_each_other():
    """tools/ imports compilepack only; benchmarks/ never imports tools/ (the GPU check lives wholly in tools/)."""
    assert _importers(ROOT / "tools", "benchmarks") == []
    assert _importers(ROOT / "benchmarks", "tools") == []
    assert _importers(ROOT / "tests", "benchmarks")  # the control: the pattern finds the tests' imports
