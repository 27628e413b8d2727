"""``python -m tools.sweeps long-rows|trainer-rows|cp-memory [options]``: the cost-table sweeps."""

from __future__ import annotations

import importlib
import sys

# command -> (module, what it does); each module has main(argv) -> exit code
COMMANDS = {
    "long-rows": ("tools.sweeps.long_rows", "a step's cost against the tokens per row"),
    "trainer-rows": ("tools.sweeps.trainer_rows", "HF Trainer / SFTTrainer steps at real vocabularies, 4k-32k rows"),
    "cp-memory": ("tools.sweeps.cp_memory", "peak memory per rank under context parallelism, W = 1, 2, 4"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip() + "\n\ncommands:")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:<13} {what}")
        print("\n`python -m tools.sweeps <command> --help` lists a command's options.")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, _ = COMMANDS[argv[0]]
    return importlib.import_module(module).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
