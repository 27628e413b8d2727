"""``python -m tools.gpu_check``: the GPU check (``run.py``), run from a checkout."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()  # before torch's import: the budget counts the imports too


def _checkout_patches() -> None:
    """Make ``compilepack.patches`` the checkout's ``patches/`` where compilepack is not installed (the lent GPU's
    image runs the checkout from PYTHONPATH; only ``pip install`` maps that folder into the package)."""
    if importlib.util.find_spec("compilepack.patches") is not None:
        return
    folder = Path(__file__).resolve().parents[2] / "patches"
    spec = importlib.util.spec_from_file_location(
        "compilepack.patches", folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["compilepack.patches"] = module
    spec.loader.exec_module(module)


if __name__ == "__main__":
    _checkout_patches()
    from .run import main  # after the mapping: run's imports reach compilepack.patches

    raise SystemExit(main(started=STARTED))
