"""``python -m benchmarks``: training-step speed and correctness, stock vs patched, on the same documents.

Every family runs the chosen modes (the default leaves two out, ``--full`` runs all) on the same documents, each
mode in its own warm worker; the timed steps are taken round-robin across a family's workers, so ratios between
modes are paired per round. Writes ``<out>/<device>-<date>.json``, ``.md`` and ``.png``; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch
import transformers

import compilepack
from compilepack.patching import family_named
from compilepack.testing import padded_batch

from . import history
from .bars import evaluate
from .flops import matmul_gflops
from .isolation import ProcessContext
from .measure import load_average
from .modes import DEFAULT_MODES, EAGER, LEFT_OUT_BY_DEFAULT, MODE_NAMES, Workload, mode_named
from .report import add_ratios, markdown, plot, print_console, tokens_cell
from .rounds import round_order, run_family, warm_up_in_lanes
from .worker import ModeSpec

DEFAULT_FAMILIES = ("llama", "qwen3_next", "qwen3_5", "bamba")
# The `bench` extra, checked before any work: module -> what it is for
REQUIRED = {"psutil": "peak memory per mode and stopping a worker's compile processes", "tqdm": "the progress bar",
            "rich": "the console table"}
# Every run's fixed settings, recorded in the report as they always were: the compiled modes of every family warm
# up first, one cold compile per core ("compiles-first"); each mode compiles cold from its own inductor cache, with
# dynamo's specialize_float on (stock and patched alike), and keeps freed memory as a GPU's caching allocator does.
WARMUP, ALLOCATOR, SPECIALIZE_FLOAT = "compiles-first", "keep", True
COMPILE_LANES = max(1, os.cpu_count() or 1)  # cold compiles at once: one per core (a compile keeps about one busy)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=",".join(DEFAULT_FAMILIES),
                        help=f"comma-separated families, or 'all' (default: {','.join(DEFAULT_FAMILIES)})")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated modes, or 'all' (default: {','.join(DEFAULT_MODES)})")
    parser.add_argument("--full", action="store_true", help="every mode (the full matrix; same as --modes all)")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds per mode, round-robin (default: 3)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="warm-up steps per mode, the compile (default: 1)")
    parser.add_argument("--tokens-per-step", type=int, default=8192, help="real tokens a step, at most (default: 8192)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--mode-timeout", type=float, default=120.0,
                        help="seconds a mode may take to build, check, compile and warm up (default: 120)")
    parser.add_argument("--step-timeout", type=float, default=300.0,
                        help="seconds a mode may take for one timed round (the slowest: ~17 s; default: 300)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document mix and the weights")
    parser.add_argument("--out", default=str(history.RESULTS), help="output directory (default: benchmarks/results)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG plot (no matplotlib needed)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks [train] [options]``: ``train``, the one command, may be left out."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv[1:] if argv[:1] == ["train"] else argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    can_plot = check_dependencies(plot=not args.no_plot)  # before any work: a missing package stops it here
    families = resolve_families(args.model)
    modes, mode_set, left_out = resolve_modes(args.modes, args.full)
    args.mode_set = mode_set
    workload = Workload(tokens_per_step=args.tokens_per_step, steps=args.steps, warmup_steps=args.warmup_steps,
                        seed=args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.device.split(':')[0]}-{datetime.date.today().isoformat()}"
    print(f"compilepack bench: {', '.join(families)}; {mode_set} modes: {', '.join(modes)}; "
          f"{args.steps} timed rounds per mode", flush=True)
    if left_out:
        print(f"left out (--full runs them): {', '.join(left_out)}", flush=True)
    started, load_start = time.monotonic(), load_average()
    matmul = [_matmul_throughput(args)]  # the physical limit the MFU is counted against, measured in this run
    with tempfile.TemporaryDirectory(prefix="compilepack-bench-") as scratch:
        results = _run_all(args, families, modes, workload, pathlib.Path(scratch), out / "logs" / stem)
    matmul.append(_matmul_throughput(args))
    report = _report(args, results, workload, time.monotonic() - started, modes, mode_set, left_out)
    report["load_avg"] = {"start": load_start, "end": load_average()}
    _add_utilization(report, matmul)
    history.write(report, out, stem, markdown, plot if can_plot else None, show=print_console,
                  no_plot=" (no .png: matplotlib is not installed, or --no-plot)")
    return 0


def check_dependencies(plot: bool = True) -> bool:
    """Stop (naming each missing package, what it is for and the install command) when a required package is
    missing; warn when matplotlib is. Returns whether the plot can be drawn."""
    missing = [module for module in REQUIRED if not importlib.util.find_spec(module)]
    if missing:
        raise SystemExit("the benchmark needs packages that are not installed:\n"
                         + "\n".join(f"  {module}: {REQUIRED[module]}" for module in missing)
                         + f"\nInstall them with: pip install {' '.join(missing)}\n"
                         + 'or every bench extra with: pip install -e ".[bench]"  (in the checkout)')
    if plot and not importlib.util.find_spec("matplotlib"):
        print("warning: matplotlib is not installed, so this run writes no PNG plot (the JSON and markdown are "
              "written as usual). Install it with: pip install matplotlib")
        return False
    return plot


def resolve_families(text: str) -> list[str]:
    """'all' -> every registered family; else the named ones, each checked against the registry."""
    if text.strip() == "all":
        return [family.name for family in compilepack.families()]
    return [family_named(name.strip()).name for name in text.split(",") if name.strip()]


def resolve_modes(text: str | None, full: bool = False) -> tuple[list[str], str, dict[str, str]]:
    """(modes in the documented order, "default"/"full"/"custom", left-out mode -> why)."""
    if full and text is not None and text.strip() != "all":
        raise SystemExit("--full runs every mode; give either --full or --modes")
    if full or (text is not None and text.strip() == "all"):
        return list(MODE_NAMES), "full", {}
    if text is None:
        return list(DEFAULT_MODES), "default", dict(LEFT_OUT_BY_DEFAULT)
    chosen = {mode_named(name.strip()).name for name in text.split(",") if name.strip()}
    modes = [name for name in MODE_NAMES if name in chosen]
    return modes, "custom", {name: "not in --modes" for name in MODE_NAMES if name not in chosen}


def _run_all(args, families, modes, workload, scratch: pathlib.Path, log_dir: pathlib.Path) -> list[dict]:
    """Every family's results: the compiled modes of every family get ready first, as many at a time as cores;
    then each family's eager modes and its rounds."""
    from tqdm import tqdm  # a bench extra: checked before any work

    log_dir.mkdir(parents=True, exist_ok=True)
    context = ProcessContext(preload=[family_named(name).modeling for name in families])
    results = []
    units = len(modes) * (1 + workload.steps)  # per family: each mode's warm-up and its rounds
    with tqdm(total=units * len(families), desc="bench", unit="step", disable=args.no_progress,
              dynamic_ncols=True) as bar:
        def shower(family, mode):  # the progress bar's postfix: the phase each worker reports
            return lambda phase: bar.set_postfix_str(f"{family} {mode}: {phase}")

        workers = {family: {mode: context.worker(_spec(args, family, mode, workload, scratch, log_dir),
                                                 shower(family, mode)) for mode in modes} for family in families}
        count = lambda key, what: bar.update(1) if what != "ended" else None  # noqa: E731
        try:
            early = {(family, mode): w for family, by_mode in workers.items() for mode, w in by_mode.items()
                     if mode_named(mode).compile is not EAGER}
            warm = warm_up_in_lanes(early, COMPILE_LANES, args.mode_timeout, count)
            for family in families:
                done_before = bar.n
                family_warm = {mode: ok for (name, mode), ok in warm.items() if name == family}
                load_before = load_average()
                family_results = run_family(workers[family], workload.steps, args.mode_timeout, args.step_timeout,
                                            on_done=count, warm=family_warm)
                load_after = load_average()
                for result in family_results:
                    # other processes on the machine slow every figure: keep the load next to the figures it affected
                    result["load_avg"] = [load_before, load_after]
                    result["timeout_s"] = args.mode_timeout
                    bar.write(_one_line(result))
                results += family_results
                # what is measured so far, in case the run is stopped
                partial = {"partial": True, "families_done": list(dict.fromkeys(r["family"] for r in results)),
                           "results": results}
                (log_dir / "partial.json").write_text(json.dumps(partial, indent=1) + "\n")
                # a mode that ended early skips its remaining rounds; warm-ups counted before are not counted again
                bar.update(done_before + units - len(family_warm) - bar.n)
        finally:
            for by_mode in workers.values():
                for worker in by_mode.values():
                    worker.stop()
    return results


def _spec(args, family, mode, workload, scratch: pathlib.Path, log_dir: pathlib.Path):
    cache = scratch / f"inductor-{family}-{mode}"  # a fresh cache per mode: every compile is cold
    cache.mkdir()
    return ModeSpec(
        family=family, mode=mode, workload=workload, device=args.device, compile_backend=args.compile_backend,
        threads=args.threads, log_path=str(log_dir / f"{family}-{mode}.log"), inductor_cache_dir=str(cache),
        skip_known_failures=args.mode_set == "default", allocator=ALLOCATOR, specialize_float=SPECIALIZE_FLOAT,
    )


def _matmul_throughput(args) -> dict:
    return matmul_gflops(args.threads) if args.device == "cpu" else {}


def _add_utilization(report: dict, matmul: list[dict]) -> None:
    """The fp32 matmul throughput measured at the run's start and end, and every mode's MFU against the better."""
    measured = [m for m in matmul if m]
    report["matmul"] = measured
    if not measured:
        return
    peak = max(m["gflops_best"] for m in measured)
    report["matmul_gflops"] = peak
    for result in report["results"]:
        rate = result.get("model_gflops_per_s")
        result["mfu"] = round(rate / peak, 3) if rate else None


def _one_line(result: dict) -> str:
    text = f"{result['family']:>11} {result['mode']:<24} {tokens_cell(result):>22} tok/s"
    if result.get("compile_s") is not None:
        text += f"  compile {result['compile_s']:.1f} s"
    if result.get("error"):
        text += f"  error: {result['error'][:100]}"
    return text


def _report(args, results: list[dict], workload, wall_s: float, modes, mode_set, left_out) -> dict:
    add_ratios(results)
    for result in results:
        result["description"] = mode_named(result["mode"]).description
    settings = {
        "tokens_per_step": workload.tokens_per_step, "steps": workload.steps, "warmup_steps": workload.warmup_steps,
        "grouped_steps_per_round": workload.grouped_per_round, "mode_set": mode_set, "modes": list(modes),
        "left_out": left_out, "round_order": [round_order(list(modes), index) for index in range(workload.steps)],
        "interleaved": "step by step", "patched_steps_per_round": workload.grouped_per_round,
        "warmup": WARMUP, "seed": workload.seed, "compile_backend": args.compile_backend, "config": "bench",
        "widths": "bench", "time_split": False, "mode_timeout_s": args.mode_timeout,
        "step_timeout_s": args.step_timeout, "inductor_cache": "fresh per mode (cold compiles)",
        "isolation": "process", "allocator": ALLOCATOR, "specialize_float": SPECIALIZE_FLOAT,
        "compile_lanes": COMPILE_LANES,
    }
    return {"device": args.device.split(":")[0], "device_name": _device_name(args.device),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "compilepack": compilepack.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "cores": os.cpu_count(),
            "threads": args.threads or torch.get_num_threads(), "settings": settings,
            "workload": _workload_summary(workload), "results": results, "bars": evaluate(results),
            "wall_s": round(wall_s, 1)}


def _workload_summary(workload) -> dict:
    _, timed = workload.arrival_steps()
    lengths = [len(doc) for step in timed for doc in step]
    real = sum(lengths)
    padded = sum(padded_batch(step)["input_ids"].numel() for step in timed)
    mix = workload.mix
    return {"length_mix": f"lognormal(mu={mix.mu}, sigma={mix.sigma}) clipped to [{mix.min_len}, {mix.max_len}]",
            "text": "Python stdlib sources, byte-level tokens (vocab 256)", "timed_docs": len(lengths),
            "median_len": statistics.median(lengths), "mean_len": real / len(lengths), "max_len": max(lengths),
            "real_tokens_per_step": [sum(len(doc) for doc in step) for step in timed],
            "arrival_padding_frac": round(1 - real / padded, 4), "arrival_padded_over_real": round(padded / real, 2)}


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return _cpu_model() or platform.processor() or "cpu"


def _cpu_model() -> str | None:
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
