"""``python -m benchmarks``: training-step speed and correctness, stock vs patched, on the same documents.

Every family runs the chosen modes (see ``modes.py``; the default leaves two out, ``--full`` runs all) on the
same long-tailed document mix and the same real-token budget per step. Each mode of a family gets a warm worker
(its own process, with time limits); the timed steps are taken round-robin across the family's workers (see
``rounds.py``), so ratios between modes are paired per round. Writes ``<out>/<device>-<date>.json``, ``.md``
and ``.png``; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import tempfile
import time

from .history import RESULTS

DEFAULT_FAMILIES = ("llama", "qwen3_next", "qwen3_5", "bamba")


def add_arguments(parser) -> None:
    from .modes import DEFAULT_MODES

    parser.add_argument("--model", default=",".join(DEFAULT_FAMILIES),
                        help="comma-separated families, or 'all' for every registered family "
                             f"(default: {','.join(DEFAULT_FAMILIES)})")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated modes, or 'all' (default: {','.join(DEFAULT_MODES)})")
    parser.add_argument("--full", action="store_true", help="every mode (the full matrix; same as --modes all)")
    parser.add_argument("--widths", choices=("bench", "real"), default="bench",
                        help="bench: the small default models (hidden 256, vocabulary 256); real: each family at "
                             "the widths of its smallest released checkpoint, one layer of each kind, vocabulary "
                             "matrices frozen, with the time split and MFU (see docs/benchmarks.md; default: bench)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed rounds per mode, taken round-robin across a family's modes "
                             f"(default: 3; {REAL_DEFAULTS['steps']} with --widths real)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="warm-up steps per mode, the compile for compiled modes (default: 1)")
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help="real (non-padding) tokens per step, at most "
                             f"(default: 8192; {REAL_DEFAULTS['tokens_per_step']} with --widths real)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--mode-timeout", type=float, default=None,
                        help="seconds a mode's worker may take to get ready (build, check, compile, warm-up) "
                             "before it is stopped and reported as timed out (default: 120; 900 with --widths real)")
    parser.add_argument("--step-timeout", type=float, default=None,
                        help="seconds a mode may take for one timed round, a stop for a step that hangs, not a "
                             "budget: on 2 idle cores the slowest round takes ~17 s (default: 300; 1800 with --widths real)")
    parser.add_argument("--warmup", choices=("compiles-first", "concurrent", "serial", "one-at-a-time"), default=None,
                        help="compiles-first: the compiled modes of every family get ready first, one compile "
                             "per core at a time, then each family's eager modes together, before its rounds "
                             "(default); concurrent: a family's workers warm up (compile) together, before its "
                             "rounds; serial: one after another, compile times without contention; one-at-a-time: each "
                             "mode runs all its rounds and exits before the next starts, so one model is held at a "
                             "time (the default with --widths real), rounds no longer side by side")
    parser.add_argument("--inductor-cache", choices=("fresh", "shared"), default="fresh",
                        help="fresh: every mode compiles cold, from an empty inductor cache (default); "
                             "shared: use torch's usual on-disk cache (faster reruns, warm compile times)")
    parser.add_argument("--specialize-float", action=argparse.BooleanOptionalAction, default=True,
                        help="compile with torch._dynamo.config.specialize_float = True, stock and patched alike: "
                             "modules' float attributes become constants and dynamo does not restart its analysis "
                             "(11-13 s of a ~55 s cold Llama compile); --no-specialize-float keeps torch's default")
    parser.add_argument("--allocator", choices=("keep", "system"), default="keep",
                        help="keep: each worker's allocator keeps freed memory for reuse, as the CUDA caching "
                             "allocator does (glibc otherwise page-faults every block over 32 MB again at each "
                             "step); system: the C library's defaults (default: keep)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document mix and the weights")
    parser.add_argument("--out", default=str(RESULTS), help="output directory (default: benchmarks/results)")
    parser.add_argument("--isolation", choices=("process", "none"), default="process",
                        help="process: each mode's worker in its own process, with the time limits (default); "
                             "none: all in this process, no time limits (debugging)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one extra (untimed) step per mode with torch.profiler; top ops go in the JSON")
    parser.add_argument("--time-split", action="store_true",
                        help="one extra (untimed) step per eager mode timed by part: mixers, MLP, LM head, loss, "
                             "optimizer, other (on by default with --widths real)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG plot (no matplotlib needed)")


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks [train] [options]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args) -> int:
    from . import dependencies
    from .modes import Workload

    apply_width_defaults(args)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    can_plot = dependencies.check(plot=not args.no_plot)  # before any work: a missing package stops it here
    families = resolve_families(args.model, args.widths)
    modes, mode_set, left_out = resolve_modes(args.modes, args.full, args.widths)
    args.mode_set = mode_set
    # one mode at a time (real widths: 10-60 s steps) nothing is interleaved, so a patched round is one step
    workload = Workload(tokens_per_step=args.tokens_per_step, steps=args.steps, warmup_steps=args.warmup_steps,
                        seed=args.seed, patched_repeats=1 if args.warmup == "one-at-a-time" else None)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    widths = "" if args.widths == "bench" else f"{args.widths}-"
    stem = f"{_device_label(args.device)}-{widths}{datetime.date.today().isoformat()}"
    print(f"compilepack bench: {', '.join(families)}; {mode_set} modes: {', '.join(modes)}; "
          f"{args.steps} timed rounds per mode", flush=True)
    if left_out:
        print(f"left out (--full runs them): {', '.join(left_out)}", flush=True)
    started, load_start = time.monotonic(), _load_average()
    matmul = [_matmul_throughput(args)]  # the physical limit the MFU is counted against, measured in this run
    with tempfile.TemporaryDirectory(prefix="compilepack-bench-") as scratch:
        results = _run_all(args, families, modes, workload, pathlib.Path(scratch), out / "logs" / stem)
    matmul.append(_matmul_throughput(args))
    report = _report(args, results, workload, time.monotonic() - started, modes, mode_set, left_out)
    report["load_avg"] = {"start": load_start, "end": _load_average()}
    _add_utilization(report, matmul)
    _write(report, out, stem, can_plot)
    return 0


# What --widths real changes when the option is not given: a real-width step takes 10-60 s on 2 CPU cores, and a
# worker holds 1-12 GB, so fewer, shorter steps, the two modes the issue compares (modes.REAL_WIDTH_MODES), and one
# worker at a time.
REAL_DEFAULTS = {"steps": 2, "tokens_per_step": 512, "warmup": "one-at-a-time", "mode_timeout": 900.0,
                 "step_timeout": 1800.0}
BENCH_DEFAULTS = {"steps": 3, "tokens_per_step": 8192, "warmup": "compiles-first", "mode_timeout": 120.0,
                  "step_timeout": 300.0}
REAL_LEFT_OUT = ("at real widths a CPU step is 85-95% dense matmuls (the LM head and the projections), which "
                 "compiling does not change, and each compiled mode costs a cold compile; give --modes to run it")


def apply_width_defaults(args) -> None:
    """Fill the options left unset with the defaults of the chosen widths."""
    defaults = REAL_DEFAULTS if args.widths == "real" else BENCH_DEFAULTS
    for name in ("steps", "tokens_per_step", "warmup", "mode_timeout", "step_timeout"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.widths == "real":
        args.time_split = True


def resolve_families(text: str, widths: str = "bench") -> list[str]:
    """'all' -> every registered family (with a config at these widths); else the named ones, each checked
    against the registry and, at real widths, against the real-width configs."""
    from compilepack.patching import families, family_named

    from .configs import has_config

    if text.strip() == "all":
        return [family.name for family in families() if has_config(family, widths)]
    chosen = [family_named(name.strip()) for name in text.split(",") if name.strip()]
    missing = [family.name for family in chosen if not has_config(family, widths)]
    if missing:
        have = sorted(family.name for family in families() if has_config(family, widths))
        raise SystemExit(f"--widths {widths}: no config for {', '.join(missing)}; families with one: "
                         f"{', '.join(have)} (each declares its Family.checkpoint in patches/<family>.py)")
    return [family.name for family in chosen]


def resolve_modes(text: str | None, full: bool = False, widths: str = "bench") -> tuple[list[str], str, dict[str, str]]:
    """(modes in the documented order, "default"/"full"/"custom", left-out mode -> why)."""
    from .modes import DEFAULT_MODES, LEFT_OUT_BY_DEFAULT, MODE_NAMES, REAL_WIDTH_MODES, mode_named

    if full and text is not None and text.strip() != "all":
        raise SystemExit("--full runs every mode; give either --full or --modes")
    if full or (text is not None and text.strip() == "all"):
        return list(MODE_NAMES), "full", {}
    if text is None and widths == "real":
        return list(REAL_WIDTH_MODES), "default", {name: REAL_LEFT_OUT for name in MODE_NAMES
                                                   if name not in REAL_WIDTH_MODES}
    if text is None:
        return list(DEFAULT_MODES), "default", dict(LEFT_OUT_BY_DEFAULT)
    chosen = {mode_named(name.strip()).name for name in text.split(",") if name.strip()}
    modes = [name for name in MODE_NAMES if name in chosen]
    return modes, "custom", {name: "not in --modes" for name in MODE_NAMES if name not in chosen}


# ------------------------------------------------------------------------------------------------ running


def _run_all(args, families, modes, workload, scratch: pathlib.Path, log_dir: pathlib.Path) -> list[dict]:
    from tqdm import tqdm

    from .report import write_json
    from .rounds import run_family, warm_up_in_lanes

    log_dir.mkdir(parents=True, exist_ok=True)
    make_worker = _worker_factory(args.isolation, families)
    results = []
    units = len(modes) * (1 + workload.steps)  # per family: each mode's warm-up and its rounds
    with tqdm(total=units * len(families), desc="bench", unit="step", disable=args.no_progress,
              dynamic_ncols=True) as bar:
        workers = {family: {mode: make_worker(_spec(args, family, mode, workload, scratch, log_dir),
                                              _phase_shower(bar, family, mode)) for mode in modes}
                   for family in families}
        count = lambda key, what: bar.update(1) if what != "ended" else None  # noqa: E731
        try:
            warm = {}
            if args.warmup == "compiles-first":  # every family's compiles first, as many at a time as cores
                early = {(family, mode): w for family, by_mode in workers.items() for mode, w in by_mode.items()
                         if _compiles(mode)}
                warm = warm_up_in_lanes(early, _compile_lanes(), args.mode_timeout, count)
            for family in families:
                done_before = bar.n
                family_warm = {mode: ok for (name, mode), ok in warm.items() if name == family}
                load_before = _load_average()
                family_results = run_family(
                    workers[family], workload.steps, args.mode_timeout, args.step_timeout,
                    concurrent=args.warmup != "serial", on_done=count,
                    one_at_a_time=args.warmup == "one-at-a-time", warm=family_warm,
                )
                load_after = _load_average()
                for result in family_results:
                    # other processes on the machine slow every figure: keep the load next to the figures it affected
                    result["load_avg"] = [load_before, load_after]
                    result["timeout_s"] = args.mode_timeout if args.isolation == "process" else None
                    bar.write(_one_line(result))
                results += family_results
                # what is measured so far, in case the run is stopped (a real-width run takes tens of minutes)
                write_json({"partial": True, "families_done": list(dict.fromkeys(r["family"] for r in results)),
                            "results": results}, log_dir / "partial.json")
                # a mode that ended early skips its remaining rounds; warm-ups counted before are not counted again
                bar.update(done_before + units - len(family_warm) - bar.n)
        finally:
            for by_mode in workers.values():
                for worker in by_mode.values():
                    worker.stop()
    return results


def _compiles(mode: str) -> bool:
    from .modes import EAGER, mode_named

    return mode_named(mode).compile is not EAGER


def _compile_lanes() -> int:
    """Cold compiles run at once under ``--warmup compiles-first``: one per core (a compile keeps about one busy)."""
    return max(1, os.cpu_count() or 1)


def _spec(args, family, mode, workload, scratch: pathlib.Path, log_dir: pathlib.Path):
    from .worker import ModeSpec

    return ModeSpec(
        family=family, mode=mode, workload=workload, device=args.device, compile_backend=args.compile_backend,
        threads=args.threads, log_path=str(log_dir / f"{family}-{mode}.log"),
        inductor_cache_dir=_cache_dir(args.inductor_cache, scratch, family, mode), profile=args.profile,
        widths=args.widths, time_split=args.time_split, skip_known_failures=args.mode_set == "default",
        allocator=args.allocator, specialize_float=args.specialize_float,
    )


def _phase_shower(bar, family: str, mode: str):
    return lambda phase: bar.set_postfix_str(f"{family} {mode}: {phase}")


def _worker_factory(isolation: str, families: list[str]):
    from .isolation import LocalWorker, ProcessContext

    if isolation == "none":
        return LocalWorker
    from compilepack.patching import family_named

    context = ProcessContext(preload=[family_named(name).modeling for name in families])
    return context.worker


def _matmul_throughput(args) -> dict:
    from .split import matmul_gflops

    return matmul_gflops(args.threads) if args.device == "cpu" else {}


def _add_utilization(report: dict, matmul: list[dict]) -> None:
    """The measured fp32 matmul throughput (at the run's start and end) and every mode's model FLOPs utilization
    against the better of the two: useful model FLOPs per second (split.step_flops) over that throughput."""
    measured = [m for m in matmul if m]
    report["matmul"] = measured
    if not measured:
        return
    peak = max(m["gflops_best"] for m in measured)
    report["matmul_gflops"] = peak
    for result in report["results"]:
        rate = result.get("model_gflops_per_s")
        result["mfu"] = round(rate / peak, 3) if rate else None


def _load_average() -> float | None:
    from .measure import load_average

    return load_average()


def _cache_dir(policy: str, scratch: pathlib.Path, family: str, mode: str) -> str | None:
    if policy == "shared":
        return None
    path = scratch / f"inductor-{family}-{mode}"
    path.mkdir()
    return str(path)


def _one_line(result: dict) -> str:
    from .report import tokens_cell

    text = f"{result['family']:>11} {result['mode']:<24} {tokens_cell(result):>22} tok/s"
    if result.get("compile_s") is not None:
        text += f"  compile {result['compile_s']:.1f} s"
    if result.get("error"):
        text += f"  error: {result['error'][:100]}"
    return text


# ------------------------------------------------------------------------------------------------ report


def _report(args, results: list[dict], workload, wall_s: float, modes, mode_set, left_out) -> dict:
    import torch
    import transformers

    import compilepack

    from .bars import evaluate
    from .modes import mode_named
    from .report import add_ratios
    from .rounds import round_order

    add_ratios(results)
    for result in results:
        result["description"] = mode_named(result["mode"]).description
    return {
        "device": _device_label(args.device),
        "device_name": _device_name(args.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compilepack": compilepack.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "threads": args.threads or torch.get_num_threads(),
        "settings": {
            "tokens_per_step": workload.tokens_per_step,
            "steps": workload.steps,
            "warmup_steps": workload.warmup_steps,
            "grouped_steps_per_round": workload.grouped_per_round,
            "mode_set": mode_set,
            "modes": list(modes),
            "left_out": left_out,
            "round_order": [round_order(list(modes), index) for index in range(workload.steps)],
            # rounds.run_family: a round's steps alternate with the other modes' (not with one-at-a-time warm-up)
            "interleaved": "one mode at a time" if args.warmup == "one-at-a-time" else "step by step",
            "patched_steps_per_round": workload.patched_steps_per_round,
            "warmup": args.warmup,
            "seed": workload.seed,
            "compile_backend": args.compile_backend,
            "config": "bench" if args.widths == "bench" else f"{args.widths}-width",
            "widths": args.widths,
            "time_split": args.time_split,
            "mode_timeout_s": args.mode_timeout if args.isolation == "process" else None,
            "step_timeout_s": args.step_timeout if args.isolation == "process" else None,
            "inductor_cache": "fresh per mode (cold compiles)" if args.inductor_cache == "fresh" else "shared",
            "isolation": args.isolation,
            "allocator": args.allocator,
            "specialize_float": args.specialize_float,
            "compile_lanes": _compile_lanes() if args.warmup == "compiles-first" else None,
        },
        "workload": _workload_summary(workload),
        "results": results,
        "bars": evaluate(results),
        "wall_s": round(wall_s, 1),
    }


def _workload_summary(workload) -> dict:
    from . import data

    _, timed = workload.arrival_steps()
    lengths = [len(doc) for step in timed for doc in step]
    real = sum(lengths)
    padded = sum(data.padded_batch(step)["input_ids"].numel() for step in timed)
    mix = workload.mix
    return {
        "length_mix": f"lognormal(mu={mix.mu}, sigma={mix.sigma}) clipped to [{mix.min_len}, {mix.max_len}]",
        "text": "Python stdlib sources, byte-level tokens (vocab 256)",
        "timed_docs": len(lengths),
        "median_len": statistics.median(lengths),
        "mean_len": real / len(lengths),
        "max_len": max(lengths),
        "real_tokens_per_step": [sum(len(doc) for doc in step) for step in timed],
        "arrival_padding_frac": round(1 - real / padded, 4),
        "arrival_padded_over_real": round(padded / real, 2),
    }


def _write(report: dict, out: pathlib.Path, stem: str, can_plot: bool = True) -> None:
    """The run's JSON, markdown and plot; its rows appended to the history table; older runs of its kind removed
    from ``out`` (the latest run of each kind is what the folder keeps)."""
    from .history import write
    from .report import markdown, plot, print_console

    write(report, out, stem, markdown, plot if can_plot else None, history=True, show=print_console,
          no_plot=" (no .png: matplotlib is not installed, or --no-plot)")


def _device_label(device: str) -> str:
    return device.split(":")[0]


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return _cpu_model() or platform.processor() or "cpu"


def _cpu_model() -> str | None:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None
