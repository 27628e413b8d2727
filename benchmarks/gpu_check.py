"""The GPU check's entry (the check itself: ``tools/gpu_check/``, its sections in ``tools/gpu_check/run.py``).

    python benchmarks/gpu_check.py --out gpu_check.json                     # on a CUDA machine (< 10 minutes)
    python benchmarks/gpu_check.py --device cpu --smoke --out smoke.json    # the same plumbing on CPU, seconds
    python benchmarks/gpu_check.py --sections long_rows,speed               # a rerun of what a short lease missed

Also ``python -m benchmarks gpu-check``. Run as a script it finds the checkout's packages itself.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, or imported from elsewhere: tools/ and benchmarks/ are the checkout's
    sys.path.insert(0, str(ROOT))


def _checkout_patches() -> None:
    """Make ``compilepack.patches`` the checkout's ``patches/`` where compilepack is not installed (the lent GPU's
    image runs the checkout from PYTHONPATH; only ``pip install`` maps that folder into the package). Seen on the
    first GPU run (2026-12-04): every family check failed with "No module named 'compilepack.patches'"."""
    if importlib.util.find_spec("compilepack.patches") is not None:
        return
    folder = ROOT / "patches"
    spec = importlib.util.spec_from_file_location(
        "compilepack.patches", folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["compilepack.patches"] = module
    spec.loader.exec_module(module)


_checkout_patches()

from tools.gpu_check.run import SECTIONS, main  # noqa: E402  (after the patches are found)

__all__ = ["SECTIONS", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
