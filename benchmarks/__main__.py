"""``python -m benchmarks [train] [options]``: the training-step benchmark (``train``, the default command). The
kernel paths on a GPU are checked by ``python -m tools.gpu_check`` (docs/benchmarks.md)."""

from __future__ import annotations

import importlib
import sys

# command -> (module, what it does); each module has main(argv) -> exit code
COMMANDS = {
    "train": ("benchmarks.train", "training steps, stock vs patched (the default command)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\ncommands:")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:<11} {what}")
        print("\n`python -m benchmarks <command> --help` lists a command's options.")
        return 0
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    return importlib.import_module(COMMANDS[command][0]).main(argv)


if __name__ == "__main__":
    sys.exit(main())
