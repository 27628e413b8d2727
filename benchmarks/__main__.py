"""``python -m benchmarks [train|ops|gpu-check|history] [options]``: one entry point for every benchmark (``train``,
the training-step benchmark, when no command is named). The cost-table sweeps (long-rows, trainer-rows, cp-memory)
are ``python -m tools.sweeps``."""

from __future__ import annotations

import importlib
import sys

# command -> (module, what it does); each module has main(argv) -> exit code
COMMANDS = {
    "train": ("benchmarks.train", "training steps, stock vs patched (the default command)"),
    "ops": ("benchmarks.ops", "each sequence-mixing op alone"),
    "gpu-check": ("benchmarks.gpu_check", "the kernel paths on a GPU, one JSON"),
    "history": ("benchmarks.history", "rebuild benchmarks/results/history.csv from result files"),
}
# commands that moved out of the benchmark: a pointer, not a run (benchmarks never imports tools.sweeps)
MOVED = {name: f"python -m tools.sweeps {name}" for name in ("long-rows", "trainer-rows", "cp-memory")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\ncommands:")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:<11} {what}")
        print("\n`python -m benchmarks <command> --help` lists a command's options.")
        return 0
    if argv and argv[0] in MOVED:
        print(f"`python -m benchmarks {argv[0]}` moved: run `{MOVED[argv[0]]}` (the cost-table sweeps, tools/sweeps/)",
              file=sys.stderr)
        return 2
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    module, _ = COMMANDS[command]
    return importlib.import_module(module).main(argv)


if __name__ == "__main__":
    sys.exit(main())
