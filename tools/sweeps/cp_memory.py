"""``python -m tools.sweeps cp-memory``: what context parallelism buys in memory. Peak memory per rank of one training
step on one packed row of ``T`` tokens, at W = 1, 2 and 4 CPU processes (gloo, the sequence mode), with the stock
LM head and with the chunked one (``patch(model, lm_head="chunked")``), beside the cost model's prediction.

Each point is one family at its smallest released checkpoint's widths (``Family.checkpoint``: one decoder layer of
each kind, the real vocabulary, fp32, random weights, as ``trainer_rows``), one row of ``T`` tokens in
``--docs`` equal documents, one W and one head. W = 1 is the model patched without context parallelism; W > 1 is
``ContextParallel.sequence_parallel`` over the W processes of one ``torchrun``, each rank on its ``T / W`` slice
(``shard_batch``), the gradients summed (``all_reduce_gradients``), one SGD step.

Measured per rank: the memory resident once the model is built and patched (``VmRSS``: weights and imports;
the peak is then restarted, since building peaks above what it keeps), the peak resident memory (``VmHWM``) of the
step, and the step's wall time (the ranks share the machine's cores: on 2 cores W ranks
do not run W times faster). The largest rank's figures are reported. A point whose processes pass
``--memory-limit`` GB together is stopped and reported as out of memory with the figure where it stopped.

The cost model (``compilepack.distributed.cost.mixer_memory``, fp32 here) predicts the mixers' saved activations per
rank, not the per-token layers nor the LM head: the table puts it beside the measured step peak (peak minus the
built model).

``--narrow``: the mixers (attention, the linear mixers) at the release's widths, the vocabulary cut to
``NARROW_VOCAB`` and the MLP to ``NARROW_MLP`` wide, so that the weights of a release too large for W copies on one
machine (Bamba-9B's 1.55 B parameters at one layer of each kind) leave room for the activations that context
parallelism splits; every output names such points ``family (narrow)``.

Writes ``cp-memory-cpu-<date>.json``, ``.md`` and ``.png`` to ``benchmarks/results`` (the points under
``measurements``: ``benchmarks.history`` reads a ``points`` report as the long-rows sweep's).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time

from benchmarks.measure import load_average

from . import sweep

FAMILIES = ("qwen3_5", "bamba")
ROWS = (8192, 16384, 32768)
WORLDS = (1, 2, 4)
HEADS = ("stock", "chunked")
NARROW_VOCAB, NARROW_MLP = 32_000, 1_024


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    started, load = time.monotonic(), load_average()
    points = []
    for family in args.families.split(","):
        for head in args.heads.split(","):
            for tokens in sweep.numbers(args.rows):
                for world in sweep.numbers(args.worlds):
                    point = {"family": family, "tokens": tokens, "world": world, "head": head, "docs": args.docs,
                             "narrow": args.narrow}
                    points.append({**point, **_run_point(point, args.memory_limit, args.point_timeout)})
                    print(_line(points[-1]), flush=True)
    out, stem = pathlib.Path(args.out), f"cp-memory-cpu-{sweep.today()}"
    report = sweep.report_of(args, started, load, measurements=points)
    if args.append:
        report = sweep.with_earlier(report, out, stem)
    sweep.write(report, out, stem, markdown, None if args.no_plot else draw)
    return 0


def _parser():
    parser = sweep.parser("cp-memory", __doc__, families=FAMILIES, rows=ROWS, memory_limit=18.0, point_timeout=1800.0)
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="processes (default: %(default)s)")
    parser.add_argument("--heads", default=",".join(HEADS), help="stock, chunked (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=8, help="documents per packed row (default: 8)")
    parser.add_argument("--narrow", action="store_true",
                        help=f"the mixers at released widths, vocabulary {NARROW_VOCAB:,}, MLP {NARROW_MLP:,} wide")
    return parser


def config_of(point: dict):
    """The point's model config: the release's widths, or with ``narrow`` its vocabulary and MLP cut."""
    config = sweep.real_config(point["family"])
    if point.get("narrow"):
        text = config.get_text_config()
        text.vocab_size = NARROW_VOCAB
        text.intermediate_size = NARROW_MLP
    return config


def name_of(point: dict) -> str:
    return f"{point['family']} (narrow)" if point.get("narrow") else point["family"]


# ------------------------------------------------------------------------------------------------ the parent


def _run_point(point: dict, limit_gb: float, timeout: float) -> dict:
    """One point in its own ``torchrun`` (or one process at W = 1), stopped past ``limit_gb`` of RSS summed over its
    processes; the largest rank's figures, or why there are none."""
    with tempfile.TemporaryDirectory() as folder:
        child = ["-m", "tools.sweeps.cp_memory", "--child", json.dumps({**point, "out": folder})]
        if point["world"] > 1:
            child = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={point['world']}", *child]
        stopped, returncode, output = sweep.run_child([sys.executable, *child], limit_gb, timeout,
                                                      env={"OMP_NUM_THREADS": "1"})
        if stopped is not None:
            return stopped
        ranks = [json.loads(p.read_text()) for p in sorted(pathlib.Path(folder).glob("rank-*.json"))]
    if returncode != 0 or len(ranks) != point["world"]:
        return sweep.failure(returncode, output)
    largest = max(ranks, key=lambda rank: rank["peak_gb"])
    return {"status": "ok", **largest, "step_s": max(rank["step_s"] for rank in ranks),
            "predicted_mixers_gb": _predicted_gb(point)}


def _predicted_gb(point: dict) -> float:
    """The cost model's mixers' activations per rank (fp32), summed over the model's layers."""
    from compilepack.distributed.cost import Cluster, mixer_memory, mixers_of

    config = config_of(point)
    fp32 = Cluster(activation_bytes=4)
    return round(sum(mixer_memory(m, "sequence", point["world"], point["tokens"], cluster=fp32)
                     for m in mixers_of(config)) / 1e9, 3)


def _line(point: dict) -> str:
    head = f"{name_of(point):<8} T={point['tokens']:>6} W={point['world']} {point['head']:<8}"
    if point["status"] != "ok":
        return (f"{head} {point['status']} {point.get('peak_gb', '')} {point.get('stopped_at_rank_gb', '')} "
                f"{point.get('error', '')}")
    return (f"{head} peak {point['peak_gb']:.2f} GB (model {point['model_gb']:.2f}, predicted mixers "
            f"{point['predicted_mixers_gb']:.2f}) step {point['step_s']:.1f} s")


# ------------------------------------------------------------------------------------------------ one rank


def _child(point: dict) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import compilepack

    torch.manual_seed(0)
    torch.set_num_threads(1)
    world = point["world"]
    lm_head = "chunked" if point["head"] == "chunked" else None
    model = transformers.AutoModelForCausalLM.from_config(config_of(point)).train()
    cp = None
    if world > 1:
        from compilepack.distributed import ContextParallel

        dist.init_process_group("gloo")
        cp = ContextParallel.sequence_parallel(dist.group.WORLD)
    compilepack.patch(model, context_parallel=cp, lm_head=lm_head)
    model_gb = sweep.vm_rss_gb()  # what the built model keeps resident, its weights and the imports
    sweep.reset_peak_memory()  # the peak below is the step's, not the model's initialisation's
    started = time.monotonic()
    _step(model, _batch(point, model.config.get_text_config().vocab_size), cp)
    result = {"rank": dist.get_rank() if cp else 0, "peak_gb": sweep.vm_hwm_gb(), "model_gb": model_gb,
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


# ------------------------------------------------------------------------------------------------ the report


def markdown(report: dict) -> str:
    lines = ["| family | tokens | W | LM head | peak per rank GB | model resident GB | step peak GB (peak - model) | "
             "cost model, mixers GB | step s |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for p in report["measurements"]:
        start = f"| {name_of(p)} | {p['tokens']:,} | {p['world']} | {p['head']} |"
        if p["status"] != "ok":
            largest = f"; largest rank {p['stopped_at_rank_gb']} GB" if "stopped_at_rank_gb" in p else ""
            at = p.get("stopped_at_gb", p.get("peak_gb"))  # runs before 2026-12-05 named it stopped_at_gb
            stopped = f" (stopped at {at} GB, all ranks{largest})" if at is not None else ""
            lines.append(f"{start} {p['status']}{stopped} | | | | |")
            continue
        lines.append(f"{start} {p['peak_gb']:.2f} | {p['model_gb']:.2f} | {p['peak_gb'] - p['model_gb']:.2f} | "
                     f"{p['predicted_mixers_gb']:.2f} | {p['step_s']:.0f} |")
    return "\n".join(lines) + "\n"


def draw(report: dict, path: pathlib.Path) -> None:
    """Peak memory per rank against W, one line per family, head and row length."""
    series = {}
    for p in report["measurements"]:
        if p["status"] == "ok":
            label = f"{name_of(p)}, {p['head']} head, {p['tokens'] // 1024}k tokens"
            series.setdefault(label, []).append((p["world"], p["peak_gb"]))
    sweep.panels(path, "Per-rank peak memory of one training step, smallest released widths",
                 [{"series": series, "ylabel": "peak memory per rank (GB)", "logx": False,
                   "xlabel": "ranks W (sequence mode, gloo, CPU)"}], size=(7, 4.5))


if __name__ == "__main__":
    sys.exit(main())
