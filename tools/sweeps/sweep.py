"""What the sweeps over tokens per row share (``long-rows``, ``trainer-rows``, ``cp-memory``): their common options,
a point run in a child process under a memory limit, the report (its files are written by ``benchmarks.history``'s
``write``, as the benchmark's are), and a plot's panels against ``T``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import time

from benchmarks.history import RESULTS, write  # the results folder's writer, shared with the benchmark

CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def parser(command: str, doc: str, *, families: tuple, rows: tuple, family_option: str = "--families",
           memory_limit: float | None = None, point_timeout: float | None = None) -> argparse.ArgumentParser:
    """The sweep's parser with the options every sweep has; the caller adds its own."""
    parser = argparse.ArgumentParser(prog=f"python -m tools.sweeps {command}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(family_option, default=",".join(families), help="comma-separated families (default: %(default)s)")
    parser.add_argument("--rows", default=",".join(map(str, rows)), help="tokens per row (default: %(default)s)")
    if memory_limit is not None:
        parser.add_argument("--memory-limit", type=float, default=memory_limit,
                            help="GB of RSS per point, its processes together (default: %(default)s)")
        parser.add_argument("--point-timeout", type=float, default=point_timeout, help="seconds per point at most")
        parser.add_argument("--append", action="store_true",
                            help="add these points to today's earlier sweep instead of replacing it")
        parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS), help="output directory (default: benchmarks/results)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    return parser


def real_config(family_name: str):
    """The family's smallest release's widths (``Family.checkpoint``), no cache, as a trainer sets it."""
    from benchmarks.configs import bench_config

    config = bench_config(family_name, "real")
    config.use_cache = False
    return config


def numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def today() -> str:
    return datetime.date.today().isoformat()


def report_of(args, started: float, load_start: float | None, **figures) -> dict:
    """The report every sweep writes: date, settings, load, wall time, versions, then its own figures."""
    from benchmarks.measure import load_average

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "settings": vars(args),
            "load_avg": {"start": load_start, "end": load_average()},
            "wall_s": round(time.monotonic() - started, 1), **figures, **versions()}


def with_earlier(report: dict, out: pathlib.Path, stem: str) -> dict:
    """``--append``: today's earlier sweep's points first, each run's settings, load and wall time kept."""
    earlier = out / f"{stem}.json"
    if not earlier.exists():
        return report
    previous = json.loads(earlier.read_text())
    return {**report, "runs": previous.get("runs", [previous["settings"]]) + [report["settings"]],
            "measurements": previous.get("measurements", previous.get("points", [])) + report["measurements"],
            "load_avg": {"runs": previous.get("load_avg", {}).get("runs", [previous.get("load_avg")])
                         + [report["load_avg"]]},
            "wall_s": round(previous.get("wall_s", 0) + report["wall_s"], 1)}


def run_child(command: list[str], limit_gb: float, timeout: float, env: dict | None = None) -> tuple[dict | None, int, str]:
    """Run ``command``, polling its process tree's summed RSS; past ``limit_gb`` or ``timeout`` the tree is killed.
    Returns (why it was stopped, or None; exit code; its stdout and stderr together)."""
    import psutil

    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **CHILD_ENV, **(env or {})})
    process, started, peak = psutil.Process(child.pid), time.monotonic(), 0
    while child.poll() is None:
        try:
            tree = [process, *process.children(recursive=True)]
            sizes = [p.memory_info().rss for p in tree]
        except psutil.NoSuchProcess:
            continue
        peak = max(peak, sum(sizes))
        if sum(sizes) > limit_gb * 1e9 or time.monotonic() - started > timeout:
            for p in reversed(tree):
                p.kill()
            child.communicate()
            what = "out of memory" if sum(sizes) > limit_gb * 1e9 else "timed out"
            return ({"status": what, "peak_gb": round(peak / 1e9, 2), "stopped_at_rank_gb": round(max(sizes) / 1e9, 2),
                     "limit_gb": limit_gb}, child.returncode, "")
        time.sleep(0.2)
    return None, child.returncode, child.communicate()[0]


def failure(returncode: int, output: str) -> dict:
    """A point whose process failed: out of memory when its allocation failed or it was killed, else failed."""
    oom = "allocate" in output or "out of memory" in output.lower() or returncode == -9
    return {"status": "out of memory" if oom else "failed", "error": output.strip().splitlines()[-1:] or [""]}


def vm_hwm_gb() -> float:
    """This process's peak resident memory (``VmHWM``), GB."""
    return _status_gb("VmHWM")


def vm_rss_gb() -> float:
    """This process's resident memory now (``VmRSS``), GB."""
    return _status_gb("VmRSS")


def reset_peak_memory() -> None:
    """Restart ``VmHWM`` from the resident memory now (Linux's ``clear_refs`` 5), so that the peak read next is the
    peak of what runs from here: building a model peaks above what it keeps (initialisation's temporaries)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _status_gb(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{key}:"):
                return round(int(line.split()[1]) * 1024 / 1e9, 2)
    return float("nan")


def versions() -> dict:
    import torch
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_version,
            "cores": os.cpu_count()}


def panels(path: pathlib.Path, title: str, specs: list[dict], size: tuple = (11, 4)) -> None:
    """One figure of side-by-side panels, saved to ``path``. Each spec: ``series`` (label -> ``[(x, y)]`` or
    ``[(x, y, low, high)]``, whiskers from low to high), ``ylabel``, optional ``xlabel``, ``logx`` (base 2, the
    default), ``logy``, ``styles`` (label -> line style), ``crosses`` (label -> ``[(x, y)]`` marked x), ``hline``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(specs), figsize=size, squeeze=False)
    for axis, spec in zip(axes[0], specs):
        for label, points in sorted(spec["series"].items()):
            points = sorted(points)
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            style = "o" + spec.get("styles", {}).get(label, "-")
            if points and len(points[0]) == 4:
                spread = [[y - p[2] for y, p in zip(ys, points)], [p[3] - y for y, p in zip(ys, points)]]
                line = axis.errorbar(xs, ys, yerr=spread, fmt=style, capsize=3, label=label).lines[0]
            else:
                line, = axis.plot(xs, ys, style, label=label)
            crosses = spec.get("crosses", {}).get(label, [])
            axis.scatter([x for x, _ in crosses], [y for _, y in crosses], marker="x", color=line.get_color())
        if "hline" in spec:
            axis.axhline(spec["hline"], color="grey", linewidth=0.8)
        if spec.get("logx", True):
            axis.set_xscale("log", base=2)
        if spec.get("logy"):
            axis.set_yscale("log")
        axis.set(xlabel=spec.get("xlabel", "tokens per row"), ylabel=spec["ylabel"])
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
