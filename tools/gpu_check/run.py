"""The GPU check: one command that fits one device lease, one JSON written after every section; the sections, their
budget, refusals and caches are described in docs/benchmarks.md ("GPU validation").

    python -m tools.gpu_check --out $OUT/gpu_check.json --cache-out $OUT     # on a CUDA machine, ~8 minutes cold
    python -m tools.gpu_check --simulate --families llama --out sim.json     # every section on CPU, in seconds
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path
from unittest import mock

import torch

import compilepack

from .common import HEADLINE, Budget, Context, admitted_backends, environment, guarded, hide_from_stock
from .families import check_family
from .lora import check_qlora
from .ops import check_known_bugs, check_layouts, check_ops, check_recompiles
from .probes import hopper_probes, run_hopper_probes
from .sequence import check_sequence_ops

# planned seconds on a Hopper GPU, cold caches, pruned autotuning (families: per family, the rest per section)
FAMILY_PLANNED_S = {"llama": 50, "qwen3_5": 75, "qwen3_next": 75, "bamba": 90}
PLANNED_S = {"families": 290, "ops": 30, "layouts": 40, "hopper_probes": 180, "known_bugs": 10, "sequence_ops": 30,
             "recompiles": 30, "qlora": 20}
SIMULATED_PLANNED_S = 0.5  # per section and family: --simulate --budget-s 0 shows every guard
SECTIONS = tuple(PLANNED_S)
CACHES = ("triton", "inductor")


def check_families(ctx: Context, report: dict, save) -> list:
    """The first section, one family at a time under the budget; it fills ``speed`` beside ``families``."""
    report["speed"], report["families"] = [], []
    for name in ctx.families:
        planned = SIMULATED_PLANNED_S if ctx.simulate else FAMILY_PLANNED_S.get(name, 75)
        done = ctx.budget.run(planned, lambda n=name: check_family(n, ctx), {"family": name})
        speed, checks = done if isinstance(done, tuple) else (done, done)
        report["speed"].append(speed)
        report["families"].append(checks)
        save()  # after every family too: the first section is most of the run
    return report["families"]


CHECKS = {"ops": check_ops, "layouts": check_layouts, "hopper_probes": run_hopper_probes,
          "known_bugs": check_known_bugs, "sequence_ops": check_sequence_ops, "recompiles": check_recompiles,
          "qlora": lambda ctx: [guarded({"family": n}, lambda n=n: check_qlora(n, ctx)) for n in ctx.families]}


def write(report: dict, out: Path):
    """The JSON as it stands (after every section: a killed run still returns what it reached)."""
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2, default=str))
    os.replace(partial, out)


@contextlib.contextmanager
def caches(folder: Path, configs: int):
    """Triton's and inductor's on-disk caches under ``folder`` (autotuning results included), Triton's autotuning
    pruned to ``configs`` configs per kernel (0: all; the library's own pruning first); all restored after."""
    settings = {"TRITON_CACHE_DIR": str(folder / "triton"), "TRITON_CACHE_AUTOTUNING": "1",
                "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    # the environment set before Triton's import, and as it was after; the pruning undone first
    with mock.patch.dict(os.environ, settings), contextlib.ExitStack() as undo:
        autotuner = importlib.import_module("triton.runtime.autotuner") if importlib.util.find_spec("triton") else None
        if autotuner and configs:
            prune = autotuner.Autotuner.prune_configs
            undo.enter_context(mock.patch.object(autotuner.Autotuner, "prune_configs",
                                                 lambda self, *args, **kwargs: prune(self, *args, **kwargs)[:configs]))
        yield {**settings, "autotune_configs_per_kernel": (configs or "all") if autotuner else "no triton",
               "autotune_note": "stock and patched call the same pruned kernels (this process only: not the probes')"}


def _shell(command: str) -> None:
    subprocess.run(["bash", "-c", "set -euo pipefail; " + command], check=True, capture_output=True, text=True)


def unpack_caches(source: Path, folder: Path) -> dict:
    """The archives ``--cache-out`` wrote (``gpucache-<name>.tar.xz.<part>``), unpacked into ``folder``."""
    found = {}
    for name in CACHES:
        parts = sorted(glob.glob(str(source / f"gpucache-{name}.tar.xz.*")))
        if parts:
            (folder / name).mkdir(parents=True, exist_ok=True)
            _shell(f"cat {' '.join(parts)} | xz -d | tar -C {folder / name} -xf -")
            found[name] = len(parts)
    return found


def pack_caches(folder: Path, out: Path, limit_mb: float) -> dict:
    """Each cache as an xz tar in 15 MB parts (the device tool returns files of at most 16 MiB); inductor's is
    dropped when both together pass ``limit_mb`` (Triton's cubins and autotuning results come first)."""
    sizes = {}
    for name in (name for name in CACHES if (folder / name).is_dir()):
        _shell(f"tar -C {folder / name} -cf - . | xz -T0 -6 | split -b 15M - {out}/gpucache-{name}.tar.xz.")
        sizes[name] = sum(os.path.getsize(p) for p in glob.glob(f"{out}/gpucache-{name}.tar.xz.*")) / 2**20
    if sum(sizes.values()) > limit_mb and "inductor" in sizes:
        for part in glob.glob(f"{out}/gpucache-inductor.tar.xz.*"):
            os.remove(part)
        sizes["inductor"] = f"dropped: {sizes['inductor']:.1f} MB would pass {limit_mb} MB with Triton's"
    return sizes


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--simulate", action="store_true",
                        help="on CPU, tiny sizes, the references for the kernels: every section in seconds")
    parser.add_argument("--families", default=",".join(HEADLINE), help="comma list, or 'all'")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (simulated: eager)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds from the start after which no section starts (420: the command ends in ~8 min)")
    parser.add_argument("--sections", default="all", help=f"comma list of {','.join(SECTIONS)} (default all)")
    parser.add_argument("--cache-dir", default=".gpucache", help="Triton's and inductor's caches")
    parser.add_argument("--cache-from", help="a folder of archives --cache-out wrote (a carried earlier lease's)")
    parser.add_argument("--cache-out", help="a folder to pack the caches into, after the sections (e.g. $OUT)")
    parser.add_argument("--cache-limit-mb", type=float, default=36.0)
    parser.add_argument("--autotune-configs", type=int, default=2, help="Triton configs kept per kernel (0: all)")
    parser.add_argument("--probe", choices=["hopper"], help=argparse.SUPPRESS)  # the probes' child process
    args = parser.parse_args(argv)
    chosen = SECTIONS if args.sections == "all" else tuple(args.sections.split(","))
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; expected some of {','.join(SECTIONS)}")
    args.sections = chosen
    if args.simulate:
        args.device, args.compile_backend = "cpu", "eager"
    elif not args.probe and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or add --simulate to run every section on CPU")
    return args


def main(argv=None, started=None) -> int:
    """``started``: ``time.perf_counter()`` at the process's start (``__main__``), so that the budget counts the
    imports too."""
    started = time.perf_counter() if started is None else started
    args = parse(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    if args.probe:
        write(guarded({}, lambda: hopper_probes(device, dtype, args.simulate)), out)
        return 0
    folder = Path(args.cache_dir).resolve()
    with caches(folder, args.autotune_configs) as cache_settings:
        unpacked = unpack_caches(Path(args.cache_from), folder) if args.cache_from else {}
        admitted, refused = admitted_backends()
        names = [f.name for f in compilepack.families()] if args.families == "all" else args.families.split(",")
        hidden = {} if args.simulate else hide_from_stock(refused, names)
        budget = Budget(args.budget_s - (time.perf_counter() - started))
        ctx = Context(device, dtype, args.simulate, budget, args.compile_backend, names, admitted, refused)
        report = {"environment": environment(ctx, hidden), "caches": {**cache_settings, "unpacked": unpacked},
                  "budget_s": args.budget_s, "sections": {}}
        write(report, out)

        for name in args.sections:
            planned = SIMULATED_PLANNED_S if args.simulate else PLANNED_S[name]
            if name != "families" and budget.left() < planned:  # the families guard each family
                report[name] = budget.skipped(planned)
                report["sections"][name] = {"planned_s": planned, **report[name]}
            else:
                start = time.perf_counter()
                check = CHECKS.get(name, lambda ctx: check_families(ctx, report, lambda: write(report, out)))
                failed = guarded({}, lambda c=check, n=name: report.__setitem__(n, c(ctx)))  # None, or the error
                report.update({name: failed} if failed else {})
                report["sections"][name] = {"planned_s": planned, "wall_s": round(time.perf_counter() - start, 1)}
            report["wall_s"] = round(time.perf_counter() - started, 1)
            write(report, out)
            print(f"gpu_check: {name} {report['sections'][name]}", flush=True)
        if args.cache_out:
            report["caches"]["packed_mb"] = guarded({}, lambda: pack_caches(folder, Path(args.cache_out),
                                                                               args.cache_limit_mb))
        report["wall_s"] = round(time.perf_counter() - started, 1)
        write(report, out)
    print(f"gpu_check: {report['wall_s']} s, {out}", flush=True)
    return 0
