"""``python -m benchmarks [train] [options]``: the training-step benchmark (``benchmarks.train``, its one command,
which may be left out). The kernel paths on a GPU are checked by ``python -m tools.gpu_check`` (docs/benchmarks.md)."""

from __future__ import annotations

import sys

from .train import main as train


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return train(argv[1:] if argv[:1] == ["train"] else argv)


if __name__ == "__main__":
    sys.exit(main())
