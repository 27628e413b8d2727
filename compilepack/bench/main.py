"""``python -m compilepack bench``: training-step speed and correctness, stock vs patched, on the same documents.

Every family runs every mode (see ``modes.py``) on the same long-tailed document mix and the same real-token
budget per step; each mode runs in its own process with a time limit. Writes
``<out>/<device>-<date>.json``, ``.md`` and ``.png``; see docs/benchmarks.md.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import statistics
import tempfile
import time

DEFAULT_FAMILIES = ("llama", "qwen3_next", "qwen3_5", "bamba")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=",".join(DEFAULT_FAMILIES),
                        help="comma-separated families, or 'all' for every registered family "
                             f"(default: {','.join(DEFAULT_FAMILIES)})")
    parser.add_argument("--modes", default="all", help="comma-separated modes (default: all)")
    parser.add_argument("--steps", type=int, default=1, help="timed training steps per mode (default: 1)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="warm-up steps per mode, the compile for compiled modes (default: 1)")
    parser.add_argument("--tokens-per-step", type=int, default=8192,
                        help="real (non-padding) tokens per step, at most (default: 8192)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--mode-timeout", type=float, default=120.0,
                        help="seconds a mode may take before it is stopped and reported as timed out (default: 120)")
    parser.add_argument("--inductor-cache", choices=("fresh", "shared"), default="fresh",
                        help="fresh: every mode compiles cold, from an empty inductor cache (default); "
                             "shared: use torch's usual on-disk cache (faster reruns, warm compile times)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document mix and the weights")
    parser.add_argument("--out", default="benchmarks/results", help="output directory (default: benchmarks/results)")
    parser.add_argument("--isolation", choices=("process", "none"), default="process",
                        help="process: each mode in its own process, with the time limit (default); "
                             "none: all in this process, no time limit (debugging)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one extra (untimed) step per mode with torch.profiler; top ops go in the JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from .modes import Workload

    families = resolve_families(args.model)
    modes = resolve_modes(args.modes)
    workload = Workload(tokens_per_step=args.tokens_per_step, steps=args.steps, warmup_steps=args.warmup_steps,
                        seed=args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{_device_label(args.device)}-{datetime.date.today().isoformat()}"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compilepack-bench-") as scratch:
        results = _run_all(args, families, modes, workload, pathlib.Path(scratch), out / "logs" / stem)
    report = _report(args, results, workload, time.monotonic() - started)
    _write(report, out, stem)
    return 0


def resolve_families(text: str) -> list[str]:
    """'all' -> every registered family; else the named ones, each checked against the registry."""
    from compilepack.patching import families, family_named

    if text.strip() == "all":
        return [family.name for family in families()]
    names = [name.strip() for name in text.split(",") if name.strip()]
    return [family_named(name).name for name in names]


def resolve_modes(text: str) -> list[str]:
    from .modes import MODE_NAMES, mode_named

    if text.strip() == "all":
        return list(MODE_NAMES)
    return [mode_named(name.strip()).name for name in text.split(",") if name.strip()]


# ------------------------------------------------------------------------------------------------ running


def _run_all(args, families, modes, workload, scratch: pathlib.Path, log_dir: pathlib.Path) -> list[dict]:
    from tqdm import tqdm

    from .worker import ModeSpec

    log_dir.mkdir(parents=True, exist_ok=True)
    runner = _runner(args.isolation)
    results = []
    jobs = [(family, mode) for family in families for mode in modes]
    with tqdm(total=len(jobs), desc="bench", unit="mode", disable=args.no_progress, dynamic_ncols=True) as bar:
        for family, mode in jobs:
            spec = ModeSpec(
                family=family, mode=mode, workload=workload, device=args.device,
                compile_backend=args.compile_backend, threads=args.threads,
                log_path=str(log_dir / f"{family}-{mode}.log"),
                inductor_cache_dir=_cache_dir(args.inductor_cache, scratch, family, mode), profile=args.profile,
            )
            bar.set_postfix_str(f"{family} {mode}")
            load_before = _load_average()
            result = runner(spec, args.mode_timeout, lambda phase: bar.set_postfix_str(f"{family} {mode}: {phase}"))
            # other processes on the machine slow every figure: keep the load next to the figures it affected
            result["load_avg"] = [load_before, _load_average()]
            result["timeout_s"] = args.mode_timeout if args.isolation == "process" else None
            results.append(result)
            bar.write(_one_line(result))
            bar.update()
    return results


def _load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _runner(isolation: str):
    if isolation == "none":
        from .worker import measure_mode

        return lambda spec, timeout_s, on_phase: measure_mode(spec, lambda phase, figures: on_phase(phase))
    from .isolation import ModeRunner

    return ModeRunner().run


def _cache_dir(policy: str, scratch: pathlib.Path, family: str, mode: str) -> str | None:
    if policy == "shared":
        return None
    path = scratch / f"inductor-{family}-{mode}"
    path.mkdir()
    return str(path)


def _one_line(result: dict) -> str:
    tps = result.get("tokens_per_s")
    text = f"{result['family']:>11} {result['mode']:<24} " + (f"{tps:8.0f} tok/s" if tps else "       - tok/s")
    if result.get("compile_s") is not None:
        text += f"  compile {result['compile_s']:.1f} s"
    if result.get("error"):
        text += f"  error: {result['error'][:100]}"
    return text


# ------------------------------------------------------------------------------------------------ report


def _report(args, results: list[dict], workload, wall_s: float) -> dict:
    import torch
    import transformers

    import compilepack

    from .bars import evaluate
    from .modes import mode_named
    from .report import add_ratios

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
            "seed": workload.seed,
            "compile_backend": args.compile_backend,
            "config": "bench",
            "mode_timeout_s": args.mode_timeout if args.isolation == "process" else None,
            "inductor_cache": "fresh per mode (cold compiles)" if args.inductor_cache == "fresh" else "shared",
            "isolation": args.isolation,
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


def _write(report: dict, out: pathlib.Path, stem: str) -> None:
    from .report import markdown, plot, print_console, write_json

    write_json(report, out / f"{stem}.json")
    (out / f"{stem}.md").write_text(markdown(report))
    plot(report, out / f"{stem}.png")
    print_console(report)
    print(f"wrote {out / stem}.json, .md, .png")


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
