"""The GPU check, one prepared script for a lent GPU machine: ``python benchmarks/gpu_check.py --out ...``.

The code lives in ``compilepack/bench/gpu_check.py`` (see its docstring); this file runs it from a checkout,
installed or not.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's compilepack, if not installed

from compilepack.bench.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
