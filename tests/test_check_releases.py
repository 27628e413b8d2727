"""tools/check_releases.py without the network or a venv: the ranges it reads from pyproject, the bounds it picks,
the table row it makes of pytest's output (the runs themselves are CI's oldest-admitted stage)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_releases", ROOT / "tools" / "check_releases.py")
check_releases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_releases)


def test_every_checked_package_has_its_admitted_range_in_pyproject():
    wanted = check_releases.requirements()
    for package in check_releases.PACKAGES:
        assert str(wanted[package].specifier), f"pyproject states no range for {package}"
    assert not wanted["trl"].specifier.contains("1.15.0") and wanted["trl"].specifier.contains("1.16.0")


def test_bounds_are_the_oldest_and_newest_published_release_inside_the_range(monkeypatch):
    releases = [Version(v) for v in ["1.13.0", "1.14.2", "1.15.0", "1.16.0", "1.17.0"]]
    monkeypatch.setattr(check_releases, "published", lambda package: releases)
    assert check_releases.admitted_bounds("trl", check_releases.requirements()) == (Version("1.14.2"),
                                                                                     Version("1.16.0"))


def test_summary_of_pytest_output():
    output = ("..F\nFAILED tests/a.py::test_x - AssertionError: (6, 4)\nFAILED tests/a.py::test_y - boom\n"
              "2 failed, 9 passed, 1 skipped in 3.1s")
    assert check_releases.summarize(output) == ("9 passed / 2 failed", "tests/a.py::test_x - AssertionError: (6, 4)")
    assert check_releases.summarize("11 passed in 2.0s") == ("11 passed / 0 failed", "")
    # the control: a run that did not start is not a pass
    assert check_releases.summarize("") == ("0 passed / 0 failed", "")
    row = check_releases.table([("trl 1.17.0", "no", "9 passed / 2 failed", "a | b")]).splitlines()[-1]
    assert row == "| trl 1.17.0 | no | 9 passed / 2 failed | a \\| b |"
