"""``python -m benchmarks cp-memory``: what context parallelism buys in memory. Peak memory per rank of one training
step on one packed row of ``T`` tokens, at W = 1, 2 and 4 CPU processes (gloo, the sequence mode), with the stock
LM head and with the chunked one (``patch(model, lm_head="chunked")``), beside the cost model's prediction.

Each point is one family at its smallest released checkpoint's widths (``Family.checkpoint``: one decoder layer of
each kind, the real vocabulary, fp32, random weights, as ``benchmarks.trainer_rows``), one row of ``T`` tokens in
``--docs`` equal documents, one W and one head. W = 1 is the model patched without context parallelism; W > 1 is
``ContextParallel.sequence_parallel`` over the W processes of one ``torchrun``, each rank on its ``T / W`` slice
(``shard_batch``), the gradients summed (``all_reduce_gradients``), one SGD step.

Measured per rank: the peak resident memory (``VmHWM``) after the step, the memory once the model is built
(weights, before the step), and the step's wall time (the ranks share the machine's cores: on 2 cores W ranks
do not run W times faster). The largest rank's figures are reported. A point whose processes pass
``--memory-limit`` GB together is stopped and reported as out of memory with the figure where it stopped.

The cost model (``compilepack.distributed.cost.mixer_memory``, fp32 here) predicts the mixers' saved activations per
rank, not the per-token layers nor the LM head: the table puts it beside the measured step peak (peak minus the
built model).

Writes ``cp-memory-cpu-<date>.json``, ``.md`` and ``.png`` to ``benchmarks/results`` (the points under
``measurements``: ``benchmarks.history`` reads a ``points`` report as the long-rows sweep's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from .history import RESULTS

FAMILIES = ("qwen3_5", "bamba")
ROWS = (8192, 16384, 32768)
WORLDS = (1, 2, 4)
HEADS = ("stock", "chunked")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    started, load = time.monotonic(), os.getloadavg()[0]
    points = []
    for family in args.families.split(","):
        for head in args.heads.split(","):
            for tokens in map(int, args.rows.split(",")):
                for world in map(int, args.worlds.split(",")):
                    point = {"family": family, "tokens": tokens, "world": world, "head": head, "docs": args.docs}
                    points.append({**point, **_run_point(point, args.memory_limit, args.point_timeout)})
                    print(_line(points[-1]), flush=True)
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "settings": vars(args),
              "load_avg": {"start": load, "end": os.getloadavg()[0]}, "cpus": os.cpu_count(),
              "wall_s": round(time.monotonic() - started, 1), "measurements": points}
    out = pathlib.Path(args.out)
    stem = f"cp-memory-cpu-{datetime.date.today().isoformat()}"
    earlier = out / f"{stem}.json"
    if args.append and earlier.exists():
        previous = json.loads(earlier.read_text())
        report["measurements"] = previous["measurements"] + points
    write(report, out, stem)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cp-memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="tokens per row (default: %(default)s)")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="processes (default: %(default)s)")
    parser.add_argument("--heads", default=",".join(HEADS), help="stock, chunked (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=8, help="documents per packed row (default: 8)")
    parser.add_argument("--memory-limit", type=float, default=18.0, help="GB of RSS, all ranks together")
    parser.add_argument("--point-timeout", type=float, default=1800.0, help="seconds per point at most")
    parser.add_argument("--out", default=str(RESULTS), help="output directory (default: benchmarks/results)")
    parser.add_argument("--append", action="store_true", help="add these points to today's earlier run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


# ------------------------------------------------------------------------------------------------ the parent


def _run_point(point: dict, limit_gb: float, timeout: float) -> dict:
    """One point in its own ``torchrun`` (or one process at W = 1), stopped past ``limit_gb`` of RSS summed over its
    processes; the largest rank's figures, or why there are none."""
    import psutil

    with tempfile.TemporaryDirectory() as folder:
        child = {**point, "out": folder}
        command = [sys.executable, "-m", "benchmarks.cp_memory", "--child", json.dumps(child)]
        if point["world"] > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={point['world']}", "-m", "benchmarks.cp_memory", "--child", json.dumps(child)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        stopped, started = _watch(psutil.Process(process.pid), process, limit_gb, timeout)
        output = process.communicate()[0]
        if stopped is not None:
            what = "out of memory" if time.monotonic() - started < timeout else "timed out"
            total, largest = stopped
            return {"status": what, "stopped_at_gb": round(total / 1e9, 2),
                    "stopped_at_rank_gb": round(largest / 1e9, 2), "limit_gb": limit_gb}
        ranks = [json.loads(p.read_text()) for p in sorted(pathlib.Path(folder).glob("rank-*.json"))]
    if process.returncode != 0 or len(ranks) != point["world"]:
        oom = "allocate" in output or "out of memory" in output.lower()
        return {"status": "out of memory" if oom else "failed", "error": output.strip().splitlines()[-1:]}
    largest = max(ranks, key=lambda rank: rank["peak_gb"])
    return {"status": "ok", **largest, "step_s": max(rank["step_s"] for rank in ranks),
            "predicted_mixers_gb": _predicted_gb(point)}


def _watch(process, child, limit_gb: float, timeout: float) -> tuple[tuple[int, int] | None, float]:
    """Poll the process tree's summed RSS; kill the tree past the limit or the timeout (then the summed RSS and the
    largest process's, else None)."""
    import psutil

    started = time.monotonic()
    while child.poll() is None:
        try:
            tree = [process, *process.children(recursive=True)]
            sizes = [p.memory_info().rss for p in tree]
        except psutil.NoSuchProcess:
            continue
        if sum(sizes) > limit_gb * 1e9 or time.monotonic() - started > timeout:
            for p in reversed(tree):
                p.kill()
            child.wait()
            return (sum(sizes), max(sizes)), started
        time.sleep(0.2)
    return None, started


def _predicted_gb(point: dict) -> float:
    """The cost model's mixers' activations per rank (fp32), summed over the model's layers."""
    from compilepack.distributed.cost import Cluster, mixer_memory, mixers_of

    config = _config(point["family"])
    fp32 = Cluster(activation_bytes=4)
    return round(sum(mixer_memory(m, "sequence", point["world"], point["tokens"], cluster=fp32)
                     for m in mixers_of(config)) / 1e9, 3)


def _line(point: dict) -> str:
    head = f"{point['family']:<8} T={point['tokens']:>6} W={point['world']} {point['head']:<8}"
    if point["status"] != "ok":
        return (f"{head} {point['status']} {point.get('stopped_at_gb', '')} {point.get('stopped_at_rank_gb', '')} "
                f"{point.get('error', '')}")
    return (f"{head} peak {point['peak_gb']:.2f} GB (model {point['model_gb']:.2f}, predicted mixers "
            f"{point['predicted_mixers_gb']:.2f}) step {point['step_s']:.1f} s")


# ------------------------------------------------------------------------------------------------ one rank


def _config(family_name: str):
    from compilepack.patching import family_named

    config = family_named(family_name).checkpoint.config()
    config.use_cache = False
    return config


def _child(point: dict) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import compilepack

    torch.manual_seed(0)
    torch.set_num_threads(1)
    world = point["world"]
    lm_head = "chunked" if point["head"] == "chunked" else None
    model = transformers.AutoModelForCausalLM.from_config(_config(point["family"])).train()
    cp = None
    if world > 1:
        from compilepack.distributed import ContextParallel

        dist.init_process_group("gloo")
        cp = ContextParallel.sequence_parallel(dist.group.WORLD)
    compilepack.patch(model, context_parallel=cp, lm_head=lm_head)
    model_gb = _peak_gb()
    started = time.monotonic()
    _step(model, _batch(point, model.config.get_text_config().vocab_size), cp)
    result = {"rank": dist.get_rank() if cp else 0, "peak_gb": _peak_gb(), "model_gb": model_gb,
              "step_s": round(time.monotonic() - started, 1)}
    pathlib.Path(point["out"], f"rank-{result['rank']}.json").write_text(json.dumps(result))
    if cp is not None:
        dist.destroy_process_group()


def _batch(point: dict, vocab: int) -> dict:
    """One packed row of ``tokens`` tokens in ``docs`` equal documents, with boundaries and labels."""
    import torch
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(0)
    length = point["tokens"] // point["docs"]
    documents = torch.randint(3, vocab, (point["docs"], length), generator=generator)
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    return collate([{"input_ids": document.tolist()} for document in documents])


def _step(model, batch: dict, cp) -> None:
    """Forward, backward, the gradients summed over the ranks, one SGD step."""
    import torch

    from compilepack.distributed import all_reduce_gradients, shard_batch

    inputs = batch if cp is None else shard_batch(batch, cp)
    model(**inputs).loss.backward()
    if cp is not None:
        all_reduce_gradients(model, cp.group)
    torch.optim.SGD(model.parameters(), lr=1e-5).step()


def _peak_gb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / 1e9, 2)
    return float("nan")


# ------------------------------------------------------------------------------------------------ the report


def write(report: dict, out: pathlib.Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(markdown(report))
    draw(report, out / f"{stem}.png")


def markdown(report: dict) -> str:
    lines = ["| family | tokens | W | LM head | peak per rank GB | model built GB | step peak GB (peak - model) | "
             "cost model, mixers GB | step s |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for p in report["measurements"]:
        start = f"| {p['family']} | {p['tokens']:,} | {p['world']} | {p['head']} |"
        if p["status"] != "ok":
            largest = f"; largest rank {p['stopped_at_rank_gb']} GB" if "stopped_at_rank_gb" in p else ""
            stopped = f" (stopped at {p['stopped_at_gb']} GB, all ranks{largest})" if "stopped_at_gb" in p else ""
            lines.append(f"{start} {p['status']}{stopped} | | | | |")
            continue
        lines.append(f"{start} {p['peak_gb']:.2f} | {p['model_gb']:.2f} | {p['peak_gb'] - p['model_gb']:.2f} | "
                     f"{p['predicted_mixers_gb']:.2f} | {p['step_s']:.0f} |")
    return "\n".join(lines) + "\n"


def draw(report: dict, path: pathlib.Path) -> None:
    """Peak memory per rank against W, one line per family, head and row length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, list] = {}
    for p in report["measurements"]:
        if p["status"] == "ok":
            series.setdefault((p["family"], p["head"], p["tokens"]), []).append((p["world"], p["peak_gb"]))
    for (family, head, tokens), values in sorted(series.items()):
        worlds, peaks = zip(*sorted(values))
        axis.plot(worlds, peaks, marker="o", label=f"{family}, {head} head, {tokens // 1024}k tokens")
    axis.set(xlabel="ranks W (sequence mode, gloo, CPU)", ylabel="peak memory per rank (GB)", xticks=list(WORLDS),
             title="Per-rank peak memory of one training step, smallest released widths")
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
