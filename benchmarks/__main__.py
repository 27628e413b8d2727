"""``python -m benchmarks [train|ops|long-rows|trainer-rows|cp-memory|gpu-check|history] [options]``: one entry point for every
benchmark (``train``, the training-step benchmark, when no command is named)."""

from __future__ import annotations

import importlib
import sys

# command -> (module, what it does); each module has main(argv) -> exit code
COMMANDS = {
    "train": ("benchmarks.train", "training steps, stock vs patched (the default command)"),
    "ops": ("benchmarks.ops", "each sequence-mixing op alone"),
    "long-rows": ("benchmarks.long_rows", "a step's cost against the tokens per row"),
    "gpu-check": ("benchmarks.gpu_check", "the kernel paths on a GPU, one JSON"),
    "history": ("benchmarks.history", "rebuild benchmarks/results/history.csv from result files"),
    "trainer-rows": ("benchmarks.trainer_rows", "HF Trainer / SFTTrainer steps at real vocabularies, 4k-32k rows"),
    "cp-memory": ("benchmarks.cp_memory", "peak memory per rank under context parallelism, W = 1, 2, 4"),
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
    module, _ = COMMANDS[command]
    return importlib.import_module(module).main(argv)


if __name__ == "__main__":
    sys.exit(main())
