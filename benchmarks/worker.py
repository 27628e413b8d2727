"""One (family, mode) worker: build the model, check it, patch, compile and warm up, then run timed rounds on
command. It runs in its own process (``isolation``): empty dynamo and inductor caches, its own peak memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import time
import traceback

import torch

import compilepack
from compilepack import testing
from compilepack.patching import family_named
from compilepack.testing.reference import logits_alone, max_error
from compilepack.testing.results import describe_error

from . import measure
from .flops import step_flops
from .modes import (DYNAMIC, EAGER, STOCK_GROUPED_COMPILED, STOCK_INDUCTOR_FAILS, STOCK_PACKED, Batch, Workload,
                    mode_named)


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
    skip_known_failures: bool = False  # the default run: a stock compile known to fail reports it without running
    allocator: str = "system"  # "keep": freed memory stays in the process for reuse (measure.keep_freed_memory)
    specialize_float: bool = False  # dynamo traces float attributes as constants: see _compiled


FIGURES = ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "compile_s", "compile_cpu_s", "graphs",
           "graph_breaks", "compiles", "peak_mem_mb", "max_logit_diff", "padding_frac", "error", "note")


def empty_result(spec: ModeSpec) -> dict:
    return {"family": spec.family, "mode": spec.mode, **dict.fromkeys(FIGURES), "timed": [], "rounds": []}


class ModeSession:
    """One mode's state between commands: ``prepare()`` (batches, model, the logits-alone check, patch, compile,
    warm-up), ``run_round(r, position, part)`` (timed round ``r``, or only its step ``part``), ``finish()`` (peak
    memory). ``prepare`` and ``run_round`` return False when the mode failed: the exception is the result's
    ``error`` (a stock model refusing a packed batch is a result, not a crash), its traceback in the mode's log."""

    def __init__(self, spec: ModeSpec, report=lambda phase, figures: None):
        self.spec = spec
        self.result = empty_result(spec)
        self._report = report
        self._rss = measure.PeakRss()
        self._records: list[tuple[Batch, float, bool]] = []  # every step: batch, seconds, compiled
        self._cpu_s: list[float] = []  # a compiled mode's every step's CPU seconds (this process, its compile workers)
        self._started = time.monotonic()

    def prepare(self) -> bool:
        ok = self._attempt(self._prepare)
        self.result["warmup_wall_s"] = round(time.monotonic() - self._started, 1)
        self._rss.pause()
        return ok

    def run_round(self, index: int, position: int = 0, part: int | None = None) -> bool:
        """Timed round ``index``: every step of it, or its step ``part`` only (the driver interleaves them)."""
        self._rss.resume()
        ok = self._attempt(lambda: self._run_round(index, position, part))
        self._rss.pause()
        return ok

    def finish(self) -> dict:
        self._rss.resume()
        device = torch.device(self.spec.device)  # max allocated on CUDA, RSS above the mode's baseline elsewhere
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else self._rss.stop_mb()
        self.result["peak_mem_mb"] = round(peak, 1)
        return self.result

    def _attempt(self, work) -> bool:
        try:
            work()
            return True
        except Exception as error:  # noqa: BLE001 (whatever the mode raised is its result)
            self.result["error"] = describe_error(error)
            print(traceback.format_exc(), flush=True)  # into the mode's log
            return False

    def _phase(self, phase: str) -> None:
        self._report(phase, self.result)

    def _prepare(self) -> None:
        spec, result = self.spec, self.result
        if spec.threads:
            torch.set_num_threads(spec.threads)
        result["allocator"] = "keep" if spec.allocator == "keep" and measure.keep_freed_memory() else "system"
        result["threads"], self._device = torch.get_num_threads(), torch.device(spec.device)
        family, self._mode = family_named(spec.family), mode_named(spec.mode)
        _refuse_known_failure(spec)
        self._phase("batching")
        warmup, self._rounds = self._mode.batches(spec.workload)
        timed = [batch for batches in self._rounds for batch in batches]
        result["padding_frac"] = round(1 - sum(b.real_tokens for b in timed) / sum(b.shaped_tokens for b in timed), 4)
        result["round_steps"] = [len(batches) for batches in self._rounds]  # what the driver interleaves
        self._phase("building model")
        model = build_model(family, spec.config, spec.workload.seed).to(self._device)
        result["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
        result["trained_params_m"] = round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2)
        self._model, result["attn_implementation"] = model, model.config._attn_implementation
        if not self._mode.patched:
            result["stock_path"] = testing.stock_path(model, self._device)
        first = (warmup or self._rounds[0])[0]
        self._check_docs = first.docs[: spec.check_docs]
        self._phase("logits alone")
        self._alone = logits_alone(model, self._check_docs, self._device)
        if self._mode.name == STOCK_PACKED:
            result["max_logit_diff_position_ids_only"] = _position_ids_only_diff(
                model, first, self._check_docs, self._alone, self._device)
        if self._mode.patched:
            compilepack.patch(model)
        self._step_model = _compiled(model, self._mode, spec.compile_backend, spec.specialize_float)
        self._optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self._sync, self._counters, self._compiles = measure.synchronizer(self._device), measure.CompileCounters(), 0
        for batch in warmup:
            self._phase("compile + warm-up" if self._mode.compile is not EAGER else "warm-up")
            self._step(batch)
        result["warmup_steps"] = len(warmup)
        self._summarize()

    def _run_round(self, index: int, position: int, part: int | None) -> None:
        batches = self._rounds[index]
        for part in range(len(batches)) if part is None else [part]:
            batch = batches[part]
            self._phase(f"round {index + 1}/{len(self._rounds)}"
                        + (f", step {part + 1}/{len(batches)}" if len(batches) > 1 else ""))
            load = measure.load_average()
            seconds, compiled = self._step(batch)
            model_flops = step_flops(self._model, [len(doc) for doc in batch.docs])
            self.result["timed"].append({"round": index, "position": position, "tokens": batch.real_tokens,
                                         "seconds": round(seconds, 4), "load_avg": load, "compiled": compiled,
                                         "model_flops": model_flops})
        self._summarize()

    def _step(self, batch: Batch) -> tuple[float, bool]:
        first, compiles = not self._records, self._mode.compile is not EAGER
        graphs_before = self._counters.graphs_total()
        if first:
            self._counters = measure.CompileCounters()  # the first step's graphs and breaks, nothing before it
        # CPU seconds only where a compile can happen (compile_cpu_s); reading the process tree costs milliseconds
        cpu_before = measure.process_tree_cpu_s() if compiles else 0.0
        seconds, logits = _train_step(self._step_model, batch, self._optimizer, self._sync, self._device,
                                      keep_logits=first)
        if compiles:
            self._cpu_s.append(measure.process_tree_cpu_s() - cpu_before)
        compiled = self._counters.graphs_total() > graphs_before
        self._compiles += self._counters.graphs_total() - graphs_before
        if first:
            self.result["max_logit_diff"] = max_error(logits, measure.doc_spans(batch.tensors, self._check_docs),
                                                      self._alone)
            if compiles:
                self.result.update(graphs=self._counters.graphs, graph_breaks=self._counters.breaks)
                self.result["break_reasons"] = self._counters.break_reasons()
        self._records.append((batch, seconds, compiled))
        self.result["step_s"] = [round(s, 3) for _, s, _ in self._records]
        self.result["real_tokens"] = [b.real_tokens for b, _, _ in self._records]
        return seconds, compiled

    def _summarize(self) -> None:
        result = self.result
        result.update(summarize_rounds(result["timed"]))
        result["batches"] = len(self._records)  # "compiles" counts dynamo compiles over these batches
        if self._mode.compile is EAGER:
            return
        result["compiles"] = self._compiles
        tokens_per_s = result["tokens_per_s"]
        if not tokens_per_s:
            return
        overhead = [max(0.0, s - b.real_tokens / tokens_per_s) for b, s, _ in self._records]
        result["compile_s"] = round(overhead[0], 2)
        result["compile_cpu_s"] = _compile_cpu_s(self._records, self._cpu_s)
        result["recompile_s"] = round(sum(o for o, (_, _, c) in zip(overhead[1:], self._records[1:]) if c), 2)
        result["timed_steps_that_compiled"] = sum(1 for step in result["timed"] if step["compiled"])


def _compile_cpu_s(records: list, cpu_s: list[float]) -> float | None:
    """The first step's CPU seconds beyond what its tokens cost at the median rate of the steps that did not
    compile: the compile's CPU time, which concurrent compiles do not inflate as they do its wall time."""
    per_token = [cpu / batch.real_tokens for (batch, _, compiled), cpu in zip(records[1:], cpu_s[1:]) if not compiled]
    if not per_token:
        return None
    return round(max(0.0, cpu_s[0] - records[0][0].real_tokens * statistics.median(per_token)), 2)


def _refuse_known_failure(spec: ModeSpec) -> None:
    known = STOCK_INDUCTOR_FAILS.get(spec.family)
    if known and spec.skip_known_failures and (spec.mode, spec.compile_backend) == (STOCK_GROUPED_COMPILED, "inductor"):
        raise RuntimeError(f"not run: stock torch.compile fails in inductor for {spec.family} ({known}; it takes "
                           "40-85 s of compiling on 2 cores to fail); --full or --modes runs it")


def summarize_rounds(timed: list[dict]) -> dict:
    """The rounds of a mode's timed steps and its tokens/s: the median over the rounds in which nothing compiled
    (over all rounds, with a note, if every one compiled), with their min and max."""
    rounds = {}
    for step in timed:
        entry = rounds.setdefault(step["round"], {"round": step["round"], "position": step["position"], "tokens": 0,
                                                  "seconds": 0.0, "load_avg": step["load_avg"], "compiled": False})
        entry["tokens"] += step["tokens"]
        entry["seconds"] += step["seconds"]
        entry["compiled"] = entry["compiled"] or step["compiled"]
        if step.get("model_flops") is not None:
            entry["model_flops"] = entry.get("model_flops", 0.0) + step["model_flops"]
    for entry in rounds.values():
        entry["seconds"] = round(entry["seconds"], 4)
        entry["tokens_per_s"] = round(entry["tokens"] / entry["seconds"], 1) if entry["seconds"] > 0 else None
        if "model_flops" in entry and entry["seconds"] > 0:
            entry["model_gflops_per_s"] = round(entry["model_flops"] / entry["seconds"] / 1e9, 2)
    rounds = sorted(rounds.values(), key=lambda entry: entry["round"])
    measured = [entry for entry in rounds if entry["tokens_per_s"]]
    steady = [entry for entry in measured if not entry["compiled"]]
    figures = {"rounds": rounds, "timed_steps": len(timed), "steady": bool(measured) and len(steady) == len(measured),
               "tokens_per_s": None, "tokens_per_s_min": None, "tokens_per_s_max": None, "note": None}
    if not measured:
        return figures
    values = [entry["tokens_per_s"] for entry in (steady or measured)]
    figures.update(tokens_per_s=round(statistics.median(values), 1), tokens_per_s_min=min(values),
                   tokens_per_s_max=max(values), real_tokens_timed=sum(entry["tokens"] for entry in measured))
    rates = [entry["model_gflops_per_s"] for entry in (steady or measured) if "model_gflops_per_s" in entry]
    if rates:  # useful model FLOPs per second (flops.step_flops): the MFU's numerator
        figures["model_gflops_per_s"] = round(statistics.median(rates), 2)
    if not steady:
        figures["note"] = "every timed round recompiled: tokens/s includes compile time"
    return figures


def serve(spec: ModeSpec, connection) -> None:
    """Worker process entry point. Sends ("progress", phase, figures so far) while working, ("ready", figures)
    once warmed up, ("round", figures) after each ("round", index, position, part) command, and ("result",
    figures) after ("finish",) or when the mode failed."""
    with _output_to(spec.log_path):
        if spec.inductor_cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = spec.inductor_cache_dir
        _import_family(spec)
        session = ModeSession(spec, lambda phase, figures: connection.send(("progress", phase, dict(figures))))
        if session.prepare():
            connection.send(("ready", dict(session.result)))
            while True:
                try:
                    command = connection.recv()
                except EOFError:  # the driver is gone
                    return
                if command[0] != "round" or not session.run_round(*command[1:]):
                    break
                connection.send(("round", dict(session.result)))
        connection.send(("result", session.finish()))
        connection.close()


def _import_family(spec: ModeSpec) -> None:
    """Import what building the model imports lazily before the memory baseline (peak memory is the mode's)."""
    with contextlib.suppress(Exception):  # the session meets the same error and records it
        build_model(family_named(spec.family), spec.config, seed=0)
    gc.collect()


def build_model(family, config, seed: int) -> torch.nn.Module:
    """The family's bench model (or ``config``'s), random init from ``seed``, training mode, no cache."""
    config = family.bench_config() if config is None else config
    model = testing.build_model(config, layers=None, seed=seed, patch=False)
    for sub_config in (model.config, getattr(model.config, "text_config", None)):
        if sub_config is not None:
            sub_config.use_cache = False  # what HF Trainer sets for training
    return model.train()


def _compiled(model, mode, backend: str, specialize_float: bool = False):
    if mode.compile is EAGER:
        return model
    if specialize_float:
        # Under torch's default dynamo traces float attributes (an attention's scaling, dropout) as symbolic floats;
        # once one is specialized the analysis restarts: 11-13 s of a ~55 s cold Llama compile, stock and patched
        # alike. A worker is one mode's process, so the setting is this process's.
        torch._dynamo.config.specialize_float = True
    # Patched models promise one graph: fullgraph=True turns any break into an error we record. Stock models
    # are compiled the way users compile them, breaks allowed.
    return torch.compile(model, backend=backend, dynamic=True if mode.compile == DYNAMIC else None,
                         fullgraph=mode.patched)


def _train_step(model, batch: Batch, optimizer, sync, device, keep_logits: bool):
    tensors = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.tensors.items()}
    start = time.perf_counter()
    output = model(**tensors)
    output.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start, (output.logits.detach() if keep_logits else None)


def _position_ids_only_diff(model, batch: Batch, check_docs, alone, device) -> float:
    """What stock does with a packed row when no boundary kwarg reaches it (the silent leak, if any)."""
    tensors = {k: v.to(device) for k, v in testing.position_ids_only(batch.tensors).items()}
    with torch.no_grad():
        logits = model(**tensors).logits
    return max_error(logits, measure.doc_spans(batch.tensors, check_docs), alone)


@contextlib.contextmanager
def _output_to(path: str | None):
    """This process's stdout/stderr (warnings, compiler chatter) into the mode's log file."""
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
