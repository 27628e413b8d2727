"""``python -m benchmarks gpu-check``: the GPU check, which lives in ``tools/gpu_check/`` (run it as
``python -m tools.gpu_check``; docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: tools/ is the checkout's
    sys.path.insert(0, str(ROOT))

from tools.gpu_check.__main__ import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
