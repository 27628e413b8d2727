"""One (family, mode) measurement, run in its own process: build the model, warm up (compile), time steps.

A mode in its own process starts from empty dynamo and inductor in-memory caches, its peak memory is its own,
and a compile that runs away can be stopped from outside without losing the other modes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback

import torch

from . import measure
from .modes import DYNAMIC, EAGER, Batch, Workload, mode_named


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    family: str
    mode: str
    workload: Workload
    device: str = "cpu"
    compile_backend: str = "inductor"
    config: object = None  # a transformers config to train instead of the family's bench model (tests)
    check_docs: int = 6  # documents of the first batch compared against themselves run alone
    threads: int | None = None  # None: torch's default for the machine
    log_path: str | None = None
    inductor_cache_dir: str | None = None  # a fresh directory makes every compile cold
    profile: bool = False  # one extra, untimed step under torch.profiler: its top ops go in the result


def empty_result(spec: ModeSpec) -> dict:
    return {
        "family": spec.family,
        "mode": spec.mode,
        "tokens_per_s": None,
        "compile_s": None,
        "graphs": None,
        "graph_breaks": None,
        "compiles": None,
        "peak_mem_mb": None,
        "max_logit_diff": None,
        "padding_frac": None,
        "error": None,
        "note": None,
    }


def run_in_child(spec: ModeSpec, connection) -> None:
    """Process entry point: measure, sending ("progress", phase, figures so far) while going and
    ("result", figures) at the end, so a mode stopped from outside still reports what it measured."""
    with _output_to(spec.log_path):
        if spec.inductor_cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = spec.inductor_cache_dir
        _import_family(spec)
        result = measure_mode(spec, lambda phase, figures: connection.send(("progress", phase, dict(figures))))
    connection.send(("result", result))
    connection.close()


def measure_mode(spec: ModeSpec, report=lambda phase, figures: None) -> dict:
    """Every figure of one mode; an exception becomes the result's ``error`` with what was measured before it."""
    result = empty_result(spec)
    rss = measure.PeakRss()
    try:
        _measure(spec, result, lambda phase: report(phase, result))
    except Exception as error:  # a stock model refusing a packed batch is a result, not a crash
        result["error"] = _describe(error)
        print(traceback.format_exc(), flush=True)  # into the mode's log
    result["peak_mem_mb"] = round(measure.peak_memory_mb(torch.device(spec.device), rss), 1)
    return result


def _import_family(spec: ModeSpec) -> None:
    """Import what building the model imports lazily (transformers' modeling module and auto classes) before
    the memory baseline, so the mode's peak memory is its model, optimizer, activations and compile."""
    import gc

    from compilepack.patching import family_named

    try:
        build_model(family_named(spec.family), spec.config, seed=0)
    except Exception:  # measure_mode meets the same error and records it
        pass
    gc.collect()


def _measure(spec: ModeSpec, result: dict, report) -> None:
    import compilepack
    from compilepack.patching import family_named

    if spec.threads:
        torch.set_num_threads(spec.threads)
    result["threads"] = torch.get_num_threads()
    device = torch.device(spec.device)
    family, mode = family_named(spec.family), mode_named(spec.mode)
    report("batching")
    warmup, timed = mode.batches(spec.workload)
    _record_padding(result, timed)
    report("building model")
    model = build_model(family, spec.config, spec.workload.seed).to(device)
    result["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    result["attn_implementation"] = model.config._attn_implementation
    first = (warmup or timed)[0]
    check_docs = first.docs[: spec.check_docs]
    report("logits alone")
    alone = measure.logits_alone(model, check_docs, device)
    if mode.name == "stock_packed":
        result["max_logit_diff_position_ids_only"] = _position_ids_only_diff(model, first, check_docs, alone, device)
    if mode.patched:
        compilepack.patch(model)
    step_model = _compiled(model, mode, spec.compile_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    counters = measure.CompileCounters()
    sync = measure.synchronizer(device)
    records = []
    for index, batch in enumerate(warmup + timed):
        report(_phase(mode, index, len(warmup), len(timed)))
        graphs_before = counters.graphs
        seconds, logits = _train_step(step_model, batch, optimizer, sync, device, keep_logits=index == 0)
        if index == 0:
            spans = measure.doc_spans(batch.tensors, check_docs)
            result["max_logit_diff"] = measure.max_logit_diff(logits, spans, alone)
            if mode.compile is not EAGER:
                result.update(graphs=counters.graphs, graph_breaks=counters.breaks)
                result["break_reasons"] = counters.break_reasons()
        records.append((batch, seconds, counters.graphs > graphs_before))
        result["step_s"] = [round(s, 3) for _, s, _ in records]
    _summarize(records, len(warmup), mode, counters, result)
    if spec.profile:
        report("profiling")
        result["profile_top"] = _profile_step(step_model, timed[-1], optimizer, sync, device)


def build_model(family, config, seed: int) -> torch.nn.Module:
    """The family's bench model (or ``config``'s), random init from ``seed``, training mode, no cache."""
    from transformers import AutoModelForCausalLM

    from .configs import bench_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config if config is not None else bench_config(family.name))
    for sub_config in (model.config, getattr(model.config, "text_config", None)):
        if sub_config is not None:
            sub_config.use_cache = False  # what HF Trainer sets for training
    return model.train()


def _compiled(model, mode, backend: str):
    if mode.compile is EAGER:
        return model
    # Patched models promise one graph: fullgraph=True turns any break into an error we record. Stock models
    # are compiled the way users compile them, breaks allowed.
    return torch.compile(model, backend=backend, dynamic=True if mode.compile == DYNAMIC else None, fullgraph=mode.patched)


def _train_step(model, batch: Batch, optimizer, sync, device, keep_logits: bool):
    tensors = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.tensors.items()}
    with measure.timed() as elapsed:
        output = model(**tensors)
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
    return elapsed(), (output.logits.detach() if keep_logits else None)


def _profile_step(model, batch: Batch, optimizer, sync, device, top: int = 12) -> list[dict]:
    """Top ops by self CPU time of one more training step (after the timed ones, so timing is unaffected)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        _train_step(model, batch, optimizer, sync, device, keep_logits=False)
    events = [e for e in profiler.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1),
         "share": round(e.self_cpu_time_total / total, 3), "calls": e.count}
        for e in events[:top]
    ]


def _position_ids_only_diff(model, batch: Batch, check_docs, alone, device) -> float:
    """What stock does with a packed row when no boundary kwarg reaches it (the silent leak, if any)."""
    from . import data

    tensors = {k: v.to(device) for k, v in data.position_ids_only(batch.tensors).items()}
    with torch.no_grad():
        logits = model(**tensors).logits
    return measure.max_logit_diff(logits, measure.doc_spans(batch.tensors, check_docs), alone)


def _summarize(records, warmup_count: int, mode, counters, result: dict) -> None:
    timed = records[warmup_count:]
    steady = [(b, s) for b, s, compiled in timed if not compiled] or [(b, s) for b, s, _ in timed]
    result["steady"] = len(steady) == len(timed) and not any(compiled for _, _, compiled in timed)
    tokens_per_s = sum(b.real_tokens for b, _ in steady) / sum(s for _, s in steady)
    result["tokens_per_s"] = round(tokens_per_s, 1)
    result["real_tokens"] = [b.real_tokens for b, _, _ in records]
    result["timed_steps"] = len(timed)
    result["batches"] = len(records)  # "compiles" counts dynamo compiles over these batches
    if mode.compile is EAGER:
        return
    overhead = [max(0.0, s - b.real_tokens / tokens_per_s) for b, s, _ in records]
    result["compile_s"] = round(overhead[0], 2)
    result["recompile_s"] = round(sum(o for o, (_, _, c) in zip(overhead[1:], records[1:]) if c), 2)
    result["compiles"] = counters.graphs
    result["timed_steps_that_compiled"] = sum(1 for _, _, c in timed if c)
    if not result["steady"]:
        result["note"] = "every timed step recompiled: tokens/s includes compile time"


def _record_padding(result: dict, timed: list[Batch]) -> None:
    real = sum(b.real_tokens for b in timed)
    shaped = sum(b.shaped_tokens for b in timed)
    result["padding_frac"] = round(1 - real / shaped, 4)
    result["real_tokens_timed"] = real


def _phase(mode, index: int, warmups: int, timed: int) -> str:
    if index < warmups:
        return "compile + warm-up" if mode.compile is not EAGER else "warm-up"
    return f"step {index - warmups + 1}/{timed}"


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


@contextlib.contextmanager
def _output_to(path: str | None):
    """Send this process's stdout/stderr (warnings, compiler chatter) to the mode's log file."""
    if path is None:
        yield
        return
    with open(path, "a") as log:
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
