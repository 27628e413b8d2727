"""The pytest plugin, loaded the way a user loads it: ``pytest -p compilepack.testing`` on their test files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_user_suite_runs_with_the_plugin_flag(tmp_path):
    """tests/user_example/test_my_model.py, copied out of this repository (no conftest of ours around it), passes
    with -p compilepack.testing and fails to find its fixtures without it (the control)."""
    user_test = tmp_path / "test_my_model.py"
    user_test.write_text((ROOT / "tests" / "user_example" / "test_my_model.py").read_text())

    def pytest(*options):
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, str(user_test)]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)

    with_plugin = pytest("-p", "compilepack.testing", "-k", "refused")
    assert with_plugin.returncode == 0, with_plugin.stdout[-2000:]
    assert "1 passed" in with_plugin.stdout
    without = pytest("-k", "refused")
    assert without.returncode != 0 and "fixture 'compilepack_model_factory' not found" in without.stdout
