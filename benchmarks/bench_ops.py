"""The op benchmark: ``python benchmarks/bench_ops.py [--ops attention,...]``, i.e. ``python -m compilepack.bench.ops``.

The code lives in ``compilepack/bench/ops/``; this file runs it from a checkout, installed or not.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's compilepack, if not installed

from compilepack.bench.ops import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
