"""``python -m benchmarks [train] [options]``: the training-step benchmark (``benchmarks.train``, its one command,
which may be left out). The kernel paths on a GPU are checked by ``python -m tools.gpu_check`` (docs/benchmarks.md)."""

import sys

from .train import main

if __name__ == "__main__":
    sys.exit(main())
