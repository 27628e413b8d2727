"""``python -m compilepack check MODEL`` and ``python -m compilepack explain <family>`` (see :mod:`compilepack.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
