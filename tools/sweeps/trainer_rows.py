"""``python -m tools.sweeps trainer-rows``: training steps through HF ``Trainer`` and TRL's ``SFTTrainer`` at real
widths and real vocabularies, on one packed row of 4k to 32k tokens: where the memory goes, and the LM head's share.

Each point is one family at its smallest released checkpoint's widths (``Family.checkpoint``: one decoder layer of
each kind, the real vocabulary, fp32, random weights), one trainer, one row length ``T`` (one packed row of ``T``
tokens in ``--docs`` equal documents) and one mode:

- ``stock``: the unpatched model (HF Trainer: the stock LM head and loss, which holds the ``[T, V]`` logits, their
  fp32 copy and their gradient; SFTTrainer: TRL's own fused head). Stock cannot keep packed documents apart in
  these hybrids (its linear layers see one long sequence, given ``position_ids`` only): a cost reference;
- ``patched``: ``compilepack.patch(model)`` (HF Trainer: the stock head; SFTTrainer: TRL's head routed to
  compilepack's op);
- ``chunked``: ``compilepack.patch(model, lm_head="chunked")`` (HF Trainer only: SFTTrainer's head is already
  chunked).

Every point runs in its own process (its peak resident memory, ``VmHWM``, is its own), warm-up steps first, then
timed steps; a process that passes ``--memory-limit`` GB is stopped and reported as out of memory, as is one whose
allocation fails. The step's time is split by hooks: mixers (attention, Gated DeltaNet, Mamba2 modules, forward and
backward), MLPs, the LM head and loss (everything after the backbone, forward and backward), the optimizer step,
and the rest. Writes ``trainer-rows-cpu-<date>.json``, ``.md`` and ``.png`` to ``benchmarks/results`` (older runs
of this kind removed). The points are under ``measurements`` (not ``points``: ``benchmarks.history`` reads a
``points`` report as the long-rows sweep's).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

from benchmarks.measure import load_average

from . import sweep

FAMILIES = ("qwen3_5", "qwen3_next", "bamba")
ROWS = (4096, 8192, 16384, 32768)
MODES = ("stock", "patched", "chunked")
TRAINERS = ("hf", "sft")
PARTS = ("mixers", "mlp", "lm_head_and_loss", "optimizer", "other")
_MIXER_SUFFIXES = ("Attention", "GatedDeltaNet", "Mixer")
_MLP_SUFFIXES = ("MLP", "SparseMoeBlock")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(json.loads(args.child))), flush=True)
        return 0
    started, load_start = time.monotonic(), load_average()  # other work on the machine slows every point
    points = []
    for trainer in args.trainers.split(","):
        for family in args.families.split(","):
            for tokens in sweep.numbers(args.rows):
                for mode in args.modes.split(","):
                    if trainer == "sft" and mode == "chunked":
                        continue  # SFTTrainer's head is already chunked (TRL's, routed when patched)
                    point = {"trainer": trainer, "family": family, "tokens": tokens, "mode": mode,
                             "docs": args.docs, "warmup": args.warmup, "steps": args.steps, "compile": args.compile}
                    points.append({**point, **_run_point(point, args.memory_limit, args.point_timeout)})
                    print(_line(points[-1]), flush=True)
    out, stem = pathlib.Path(args.out), f"trainer-rows-cpu-{sweep.today()}"
    report = sweep.report_of(args, started, load_start, measurements=points)
    if args.append:  # today's earlier sweep, extended by this one (its settings kept per run)
        report = sweep.with_earlier(report, out, stem)
    sweep.write(report, out, stem, markdown, None if args.no_plot else draw)
    return 0


def _parser():
    parser = sweep.parser("trainer-rows", __doc__, families=FAMILIES, rows=ROWS, memory_limit=21.0,
                          point_timeout=3600.0)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="hf, sft (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=8, help="documents per packed row (default: 8)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: 1)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps (default: 1)")
    parser.add_argument("--compile", action="store_true",
                        help="torch_compile=True (inductor, fullgraph, dynamic): time only, no per-part split")
    return parser


def _run_point(point: dict, limit_gb: float, timeout: float) -> dict:
    """Run one point in a child process, stopped past ``limit_gb`` of RSS; its result, or why there is none."""
    command = [sys.executable, "-m", "tools.sweeps.trainer_rows", "--child", json.dumps(point)]
    stopped, returncode, output = sweep.run_child(command, limit_gb, timeout)
    if stopped is not None:
        return stopped
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if returncode != 0 or not lines:
        return sweep.failure(returncode, output)
    return json.loads(lines[-1][len("RESULT "):])


def _line(point: dict) -> str:
    head = f"{point['trainer']:>3} {point['family']:<10} T={point['tokens']:>6} {point['mode']:<8}"
    head += " compiled" if point.get("compile") else ""
    if point["status"] != "ok":
        return f"{head} {point['status']} {point.get('peak_gb', '')} {point.get('error', '')}"
    return f"{head} {point['tokens_per_s']:8.1f} tok/s  peak {point['peak_gb']:.2f} GB  {point['shares']}"


# ------------------------------------------------------------------------------------------------ one point


def _child(point: dict) -> dict:
    import torch

    torch.manual_seed(0)
    model = _model(point)
    model_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    trainer = _trainer(point, model)
    timer = _Timer(trainer.model, point["compile"])
    trainer.add_callback(timer.callback())
    try:
        trainer.train()
    except RuntimeError as error:
        if "allocate" in str(error) or "out of memory" in str(error).lower():
            return {"status": "out of memory", "error": str(error).splitlines()[0], "peak_gb": sweep.vm_hwm_gb()}
        raise
    steps = timer.steps[point["warmup"]:]
    seconds = statistics.median(s["step"] for s in steps)
    from torch._dynamo.utils import counters

    graphs = {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
    shares = {} if point["compile"] else {
        part: round(statistics.median(s[part] for s in steps) / seconds, 3) for part in PARTS}
    return {"status": "ok", "step_s": round(seconds, 2), "tokens_per_s": round(point["tokens"] / seconds, 1),
            "peak_gb": sweep.vm_hwm_gb(), "model_gb": round(model_gb, 2), "shares": shares,
            "loss": [round(x, 5) for x in timer.losses], **(graphs if point["compile"] else {})}


def _model(point: dict):
    import transformers

    import compilepack

    model = transformers.AutoModelForCausalLM.from_config(sweep.real_config(point["family"])).train()
    if point["mode"] == "patched":
        compilepack.patch(model)
    elif point["mode"] == "chunked":
        compilepack.patch(model, lm_head="chunked")
    return model


def _rows(point: dict, vocab: int, count: int) -> list[list[int]]:
    """Samples that the collator packs into one row of ``tokens`` tokens per step: ``docs`` equal documents."""
    import random

    generator = random.Random(0)
    length = point["tokens"] // point["docs"]
    return [[generator.randrange(3, vocab) for _ in range(length)] for _ in range(count * point["docs"])]


def _trainer(point: dict, model):
    import transformers

    from compilepack.integrations import with_boundaries

    steps = point["warmup"] + point["steps"]
    samples = _rows(point, model.config.vocab_size, steps)
    common = dict(output_dir="/tmp/compilepack-trainer-rows", max_steps=steps,
                  per_device_train_batch_size=point["docs"],
                  learning_rate=1e-5, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                  dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False, bf16=False,
                  torch_compile=point["compile"])
    if point["compile"]:
        os.environ.update(ACCELERATE_DYNAMO_USE_FULLGRAPH="1", ACCELERATE_DYNAMO_USE_DYNAMIC="1")
    if point["trainer"] == "hf":
        collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
        if point["mode"] == "stock":  # stock cannot take the boundary kwargs (ValueError): position_ids only
            collate = transformers.DataCollatorWithFlattening()
        return transformers.Trainer(model=model, args=transformers.TrainingArguments(**common),
                                    train_dataset=[{"input_ids": s} for s in samples], data_collator=collate)
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model=model, args=SFTConfig(padding_free=True, max_length=None, **common),
                         train_dataset=Dataset.from_dict({"input_ids": samples}), processing_class=_tokenizer())
    if point["mode"] != "stock":
        trainer.data_collator = with_boundaries(trainer.data_collator)
    else:  # position_ids only, as for HF stock
        collate = trainer.data_collator
        boundary = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
        trainer.data_collator = lambda features: {k: v for k, v in collate(features).items() if k not in boundary}
    return trainer


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(8)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", unk_token="t1", eos_token="t2")


class _Timer:
    """Per-step wall times split by part, from module hooks (forward) and tensor hooks (backward).

    A part's backward is the time from the gradient reaching its module's output to the gradient reaching its input
    (tensor hooks, so the graph is unchanged). The LM head and loss: from the backbone's output to the end of the
    model's forward, and from the start of the backward to the gradient reaching the backbone's output."""

    def __init__(self, model, compiled: bool):
        self.steps, self.losses, self.current = [], [], None
        if not compiled:  # hooks inside a compiled graph would be traced into it: time only
            self._hook(model)

    def callback(self):
        import transformers

        timer = self

        class Callback(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.current = dict.fromkeys(PARTS, 0.0)
                timer.current["start"] = time.perf_counter()

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                timer.current["optimizer_start"] = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kwargs):
                timer.current["optimizer"] += time.perf_counter() - timer.current["optimizer_start"]

            def on_step_end(self, args, state, control, **kwargs):
                step = time.perf_counter() - timer.current["start"]
                parts = {p: timer.current[p] for p in PARTS if p != "other"}
                timer.steps.append({**parts, "other": max(0.0, step - sum(parts.values())), "step": step})

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    timer.losses.append(float(logs["loss"]))

        return Callback()

    def _add(self, part: str, seconds: float) -> None:
        if self.current is not None:
            self.current[part] += seconds

    def _hook(self, model) -> None:
        backbone = getattr(model, model.base_model_prefix)
        for module in backbone.modules():
            name = type(module).__name__
            if name.endswith(_MIXER_SUFFIXES):
                self._time_module(module, "mixers")
            elif name.endswith(_MLP_SUFFIXES):
                self._time_module(module, "mlp")
        marks = {}

        def backbone_done(module, args, output):
            marks["backbone_out"] = time.perf_counter()
            hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: self._add(
                    "lm_head_and_loss", time.perf_counter() - marks.get("backward", time.perf_counter())))

        def model_done(module, args, output):
            self._add("lm_head_and_loss", time.perf_counter() - marks["backbone_out"])
            marks.pop("backward", None)

            def backward_starts(grad):  # the first output the gradient reaches (the loss, or SFT's log_probs)
                marks.setdefault("backward", time.perf_counter())

            for value in output.values():
                if hasattr(value, "requires_grad") and value.requires_grad:
                    value.register_hook(backward_starts)

        backbone.register_forward_hook(backbone_done)
        model.register_forward_hook(model_done)

    def _time_module(self, module, part: str) -> None:
        marks = {}

        def before(module, args, kwargs):
            marks["forward"] = time.perf_counter()
            first = next((a for a in [*args, *kwargs.values()] if hasattr(a, "requires_grad")), None)
            if first is not None and first.requires_grad:
                first.register_hook(lambda grad: self._add(part, time.perf_counter() - marks.get("backward", 0.0)))

        def after(module, args, kwargs, output):
            self._add(part, time.perf_counter() - marks["forward"])
            first = output[0] if isinstance(output, tuple) else output
            if hasattr(first, "requires_grad") and first.requires_grad:
                first.register_hook(lambda grad: marks.__setitem__("backward", time.perf_counter()))

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)


# ------------------------------------------------------------------------------------------------ the report


def markdown(report: dict) -> str:
    lines = [
        f"Trainer steps at real widths, one packed row ({report['date']}, torch {report.get('torch')}, transformers "
        f"{report.get('transformers')}, trl {report.get('trl')}, {report.get('cores')} CPU cores; "
        f"{' and '.join(_command(r) for r in report.get('runs', [report['settings']]))})",
        "",
        "| trainer | family | tokens | mode | tokens/s | peak GB | mixers | MLP | LM head + loss | optimizer | other |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in report["measurements"]:
        mode = f"{p['mode']}, compiled" if p.get("compile") else p["mode"]
        head = f"| {p['trainer']} | {p['family']} | {p['tokens']:,} | {mode} |"
        if p["status"] != "ok":
            peak = f"> {p['limit_gb']:g}" if p.get("limit_gb") else p.get("peak_gb", "")
            lines.append(f"{head} {p['status']} | {peak} | | | | | |")
            continue
        if p["shares"]:
            shares = " | ".join(f"{100 * p['shares'][part]:.0f}%" for part in PARTS)
        else:  # a compiled step: no split (hooks would be traced into the graph); its graph count instead
            shares = f"{p.get('graphs', '?')} graph(s), {p.get('graph_breaks', '?')} break(s) |  |  |  | (first step: compile included)"
        lines.append(f"{head} {p['tokens_per_s']:.1f} | {p['peak_gb']:.1f} | {shares} |")
    return "\n".join(lines) + "\n"


def draw(report: dict, path: pathlib.Path) -> None:
    """Peak memory (x: out of memory, at the limit) and tokens/s against the tokens per row, a line per series."""
    memory, speed, crosses = {}, {}, {}
    for p in report["measurements"]:
        label = f"{p['trainer']} {p['family']} {p['mode']}" + (", compiled" if p.get("compile") else "")
        memory.setdefault(label, [])
        speed.setdefault(label, [])
        if p["status"] == "ok":
            memory[label].append((p["tokens"], p["peak_gb"]))
            speed[label].append((p["tokens"], p["tokens_per_s"]))
        elif p["status"] == "out of memory":
            crosses.setdefault(label, []).append((p["tokens"], p.get("limit_gb") or p.get("peak_gb")))
    sweep.panels(path, "", [
        {"series": memory, "crosses": crosses, "ylabel": "peak resident memory (GB); x: out of memory",
         "xlabel": "tokens per packed row"},
        {"series": speed, "ylabel": "tokens / s", "xlabel": "tokens per packed row"}])


def _command(settings: dict) -> str:
    return f"`python -m tools.sweeps trainer-rows {_arguments(settings)}`"


def _arguments(settings: dict) -> str:
    keys = ("families", "rows", "modes", "trainers", "steps", "warmup")
    text = " ".join(f"--{k} {settings[k]}" for k in keys if k in settings)
    return text + (" --compile" if settings.get("compile") else "") + (" --append" if settings.get("append") else "")


if __name__ == "__main__":
    sys.exit(main())
