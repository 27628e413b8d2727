"""One (family, mode) worker: build the model, check it, patch, compile and warm up, then run timed rounds on
command, then summarize.

A worker normally runs in its own process (see ``isolation``): it starts from empty dynamo and inductor
in-memory caches, its peak memory is its own, and a compile or step that runs away can be stopped from outside
without losing the other modes. The driver (``rounds``) keeps one worker per mode of a family alive and asks
them for their timed rounds in turn, so a change in the machine's load hits every mode of a round alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
import traceback

import torch

from compilepack.patching.builder import function_behind

from . import measure, split
from .modes import DYNAMIC, EAGER, STOCK_GROUPED_COMPILED, STOCK_PACKED, Batch, Workload, mode_named


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
    widths: str = "bench"  # "real": the family's smallest release's widths (its Family.checkpoint)
    time_split: bool = False  # one extra, untimed eager step timed by category (split.py)
    step: tuple | None = None  # given documents, the same in every round (long_rows.py); None: the workload's
    skip_known_failures: bool = False  # the default run: a stock compile known to fail reports it without running
    allocator: str = "system"  # "keep": freed memory stays in the process for reuse (measure.keep_freed_memory)
    # dynamo traces modules' float attributes as constants (torch._dynamo.config.specialize_float), which spares
    # the compile a restart of its analysis: see _compiled
    specialize_float: bool = False


def empty_result(spec: ModeSpec) -> dict:
    return {
        "family": spec.family,
        "mode": spec.mode,
        "tokens_per_s": None,
        "tokens_per_s_min": None,
        "tokens_per_s_max": None,
        "compile_s": None,
        "compile_cpu_s": None,
        "graphs": None,
        "graph_breaks": None,
        "compiles": None,
        "peak_mem_mb": None,
        "max_logit_diff": None,
        "padding_frac": None,
        "error": None,
        "note": None,
        "timed": [],
        "rounds": [],
    }


class ModeSession:
    """One mode's state between commands. ``prepare()``: batches, model, the logits-alone check, patch, compile,
    warm-up steps; ``run_round(r, position, part)``: timed round ``r`` (its arrival step, once or repeated, or the
    grouped mode's long, middle and short steps), or only its step ``part``; ``finish()``: the optional profile
    and peak memory, and the figures. ``prepare`` and ``run_round`` return False when the mode failed: the
    exception is the result's ``error`` (a stock model refusing a packed batch is a result, not a crash) and the
    traceback goes to the mode's log. ``result`` always holds every figure measured so far, summarized after each
    round."""

    def __init__(self, spec: ModeSpec, report=lambda phase, figures: None):
        self.spec = spec
        self.result = empty_result(spec)
        self._report = report
        self._rss = measure.PeakRss()
        self._records: list[tuple[Batch, float, bool]] = []  # every step: batch, seconds, compiled
        self._cpu_s: list[float] = []  # a compiled mode's every step's CPU seconds (this process, its compile workers)
        self._started = time.monotonic()

    # ------------------------------------------------------------------------------------------ commands

    def prepare(self) -> bool:
        ok = self._attempt(self._prepare)
        self.result["warmup_wall_s"] = round(time.monotonic() - self._started, 1)
        self._rss.pause()
        return ok

    def run_round(self, index: int, position: int = 0, part: int | None = None) -> bool:
        """Timed round ``index``: every step of it, or its step ``part`` only (the driver interleaves rounds of
        several steps step by step)."""
        self._rss.resume()
        ok = self._attempt(lambda: self._run_round(index, position, part))
        self._rss.pause()
        return ok

    def finish(self) -> dict:
        self._rss.resume()
        if self.spec.profile and self.result["error"] is None and getattr(self, "_rounds", None):
            self._attempt(self._profile)
        if self.spec.time_split and self.result["error"] is None and getattr(self, "_rounds", None):
            self._attempt(self._time_split)
        self.result["peak_mem_mb"] = round(measure.peak_memory_mb(torch.device(self.spec.device), self._rss), 1)
        return self.result

    def _attempt(self, work) -> bool:
        try:
            work()
            return True
        except Exception as error:  # noqa: BLE001 (whatever the mode raised is its result)
            self.result["error"] = _describe(error)
            print(traceback.format_exc(), flush=True)  # into the mode's log
            return False

    def _phase(self, phase: str) -> None:
        self._report(phase, self.result)

    # ------------------------------------------------------------------------------------------ work

    def _prepare(self) -> None:
        import compilepack
        from compilepack.patching import family_named

        spec, result = self.spec, self.result
        if spec.threads:
            torch.set_num_threads(spec.threads)
        result["allocator"] = "keep" if spec.allocator == "keep" and measure.keep_freed_memory() else "system"
        result["threads"] = torch.get_num_threads()
        self._device = torch.device(spec.device)
        family, self._mode = family_named(spec.family), mode_named(spec.mode)
        _refuse_known_failure(spec)
        self._phase("batching")
        if spec.step is None:
            warmup, self._rounds = self._mode.batches(spec.workload)
        else:
            warmup, self._rounds = self._mode.batches_of([list(doc) for doc in spec.step], spec.workload)
        _record_padding(result, [batch for batches in self._rounds for batch in batches])
        result["round_steps"] = [len(batches) for batches in self._rounds]  # what the driver interleaves
        self._phase("building model")
        model = build_model(family, spec.config, spec.workload.seed, spec.widths).to(self._device)
        result["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
        result["trained_params_m"] = round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2)
        self._model = model
        result["attn_implementation"] = model.config._attn_implementation
        if not self._mode.patched:
            result["stock_path"] = stock_path(model, self._device)
        first = (warmup or self._rounds[0])[0]
        self._check_docs = first.docs[: spec.check_docs]
        self._phase("logits alone")
        self._alone = measure.logits_alone(model, self._check_docs, self._device)
        if self._mode.name == STOCK_PACKED:
            result["max_logit_diff_position_ids_only"] = _position_ids_only_diff(
                model, first, self._check_docs, self._alone, self._device)
        if self._mode.patched:
            compilepack.patch(model)
        self._step_model = _compiled(model, self._mode, spec.compile_backend, spec.specialize_float)
        self._optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self._sync = measure.synchronizer(self._device)
        self._counters = measure.CompileCounters()
        self._compiles = 0
        for index, batch in enumerate(warmup):
            self._phase("compile + warm-up" if self._mode.compile is not EAGER else "warm-up")
            self._step(batch)
        result["warmup_steps"] = len(warmup)
        self._summarize()

    def _run_round(self, index: int, position: int, part: int | None) -> None:
        batches = self._rounds[index]
        parts = range(len(batches)) if part is None else [part]
        for part in parts:
            batch = batches[part]
            phase = f"round {index + 1}/{len(self._rounds)}"
            self._phase(phase + (f", step {part + 1}/{len(batches)}" if len(batches) > 1 else ""))
            load = measure.load_average()
            seconds, compiled = self._step(batch)
            flops = split.step_flops(self._model, [len(doc) for doc in batch.docs])
            self.result["timed"].append({"round": index, "position": position, "tokens": batch.real_tokens,
                                         "seconds": round(seconds, 4), "load_avg": load, "compiled": compiled,
                                         "model_flops": flops})
        self._summarize()

    def _step(self, batch: Batch) -> tuple[float, bool]:
        first = not self._records
        graphs_before = self._counters.graphs_total()
        if first:
            self._counters = measure.CompileCounters()  # the first step's graphs and breaks, nothing before it
        # CPU seconds only where a compile can happen (compile_cpu_s); reading the process tree costs milliseconds
        count_cpu = self._mode.compile is not EAGER
        cpu_before = measure.process_tree_cpu_s() if count_cpu else 0.0
        seconds, logits = _train_step(self._step_model, batch, self._optimizer, self._sync, self._device,
                                      keep_logits=first)
        if count_cpu:
            self._cpu_s.append(measure.process_tree_cpu_s() - cpu_before)
        compiled = self._counters.graphs_total() > graphs_before
        self._compiles += self._counters.graphs_total() - graphs_before
        if first:
            spans = measure.doc_spans(batch.tensors, self._check_docs)
            self.result["max_logit_diff"] = measure.max_logit_diff(logits, spans, self._alone)
            if self._mode.compile is not EAGER:
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

    def _time_split(self) -> None:
        """One more step of the last round's last batch, timed by category (eager modes: hooks do not trace)."""
        if self._mode.compile is not EAGER:
            return
        self._phase("time split")
        batch = self._rounds[-1][-1]
        tensors = {k: v.to(self._device) if isinstance(v, torch.Tensor) else v for k, v in batch.tensors.items()}
        self.result["time_split"] = {**split.split_step(self._model, tensors, self._optimizer),
                                     "tokens": batch.real_tokens}

    def _profile(self) -> None:
        self._phase("profiling")
        self.result["profile_top"] = _profile_step(self._step_model, self._rounds[-1][-1], self._optimizer,
                                                   self._sync, self._device)


def _compile_cpu_s(records: list, cpu_s: list[float]) -> float | None:
    """The first step's CPU seconds beyond what its tokens cost in the steps that did not compile (median CPU
    seconds per token): the compile's CPU time, which concurrent compiles do not inflate as they do its wall time."""
    per_token = [cpu / batch.real_tokens for (batch, _, compiled), cpu in zip(records[1:], cpu_s[1:]) if not compiled]
    if not per_token:
        return None
    return round(max(0.0, cpu_s[0] - records[0][0].real_tokens * statistics.median(per_token)), 2)


def _refuse_known_failure(spec: ModeSpec) -> None:
    from .modes import STOCK_INDUCTOR_FAILS

    known = STOCK_INDUCTOR_FAILS.get(spec.family)
    if spec.skip_known_failures and spec.mode == STOCK_GROUPED_COMPILED and spec.compile_backend == "inductor" \
            and known:
        raise RuntimeError(f"not run: stock torch.compile fails in inductor for {spec.family} ({known}; it takes "
                           "40-85 s of compiling on 2 cores to fail); --full or --modes runs it")


def summarize_rounds(timed: list[dict]) -> dict:
    """The rounds of a mode's timed steps (``{"round", "position", "tokens", "seconds", "load_avg",
    "compiled"}`` each) and its tokens/s: the median over the rounds in which nothing compiled (over all rounds,
    with a note, if every one compiled), with their min and max."""
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
    if rates:  # useful model FLOPs per second (split.step_flops): the MFU's numerator
        figures["model_gflops_per_s"] = round(statistics.median(rates), 2)
    if not steady:
        figures["note"] = "every timed round recompiled: tokens/s includes compile time"
    return figures


# ------------------------------------------------------------------------------------------------ a process


def serve(spec: ModeSpec, connection) -> None:
    """Worker process entry point. Sends ("progress", phase, figures so far) while working, ("ready", figures)
    once warmed up, ("round", figures) after each ("round", index, position, part) command, and ("result",
    figures) after ("finish",) or when the mode failed; so a worker stopped from outside still reports what it measured."""
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
    """Import what building the model imports lazily (transformers' modeling module and auto classes) before
    the memory baseline, so the mode's peak memory is its model, optimizer, activations and compile."""
    import gc

    from compilepack.patching import family_named

    with contextlib.suppress(Exception):  # the session meets the same error and records it
        build_model(family_named(spec.family), spec.config, seed=0)
    gc.collect()


# ------------------------------------------------------------------------------------------------ steps


def build_model(family, config, seed: int, widths: str = "bench") -> torch.nn.Module:
    """The family's bench model (or ``config``'s), random init from ``seed``, training mode, no cache. At real
    widths the vocabulary matrices are frozen (see ``freeze_vocabulary``)."""
    from transformers import AutoModelForCausalLM

    from .configs import bench_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config if config is not None else bench_config(family.name, widths))
    for sub_config in (model.config, getattr(model.config, "text_config", None)):
        if sub_config is not None:
            sub_config.use_cache = False  # what HF Trainer sets for training
    if widths == "real":
        freeze_vocabulary(model)
    return model.train()


def stock_path(model: torch.nn.Module, device) -> str:
    """The code stock transformers runs for this model's sequence mixers, in words: its attention implementation,
    then each kernel-backed global of its modeling module (``use_kernel_func_from_hub_with_fallback``) with the
    package it found at import, or "torch fallback". Read from the wrapper's closure, so it names what runs, not
    what is installed; a package runs only on CUDA tensors, and without one a boundary kwarg makes transformers
    >= 5.20 raise. E.g. "cpu; attention: sdpa; causal_conv1d_fn: torch fallback"."""
    import sys

    parts = [torch.device(device).type, f"attention: {model.config._attn_implementation}"]
    module = sys.modules.get(type(model).__module__)
    for name, function in sorted(vars(module).items() if module else ()):
        cells = kernel_closure(function) or kernel_closure(getattr(function, "__wrapped__", None))
        if "is_new_implementation" in cells:
            found = cells["package"] if cells["is_new_implementation"] else "torch fallback"
            parts.append(f"{name}: {found}")
    return "; ".join(parts)


def kernel_closure(function) -> dict:
    """The closure cells of a transformers kernel function (``use_kernel_func_from_hub_with_fallback``'s wrapper) by
    name; from 5.25 (which requires the `kernels` package) the global is a module calling that wrapper."""
    function = function_behind(function) or function
    code = getattr(function, "__code__", None)
    if code is None or not function.__closure__:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, function.__closure__)}


def freeze_vocabulary(model: torch.nn.Module) -> None:
    """No gradient and no optimizer state for the input embedding and the LM head weights. At real widths they are
    0.25-1.05 B parameters; trained with AdamW (16 bytes a parameter) they need 4-17 GB per worker, more than the
    bench machine holds. The LM head still runs its forward and its input gradient (2/3 of its FLOPs), and the loss
    its full-vocabulary softmax."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            module.weight.requires_grad_(False)


def _compiled(model, mode, backend: str, specialize_float: bool = False):
    if mode.compile is EAGER:
        return model
    if specialize_float:
        # Under torch's default (False) dynamo traces modules' float attributes (an embedding's norm_type, an
        # attention's scaling and dropout) as symbolic floats; once one is specialized the tensorify pass restarts
        # the whole analysis, and the first attempt's work is lost: 11-13 s of a 54-59 s cold compile of the
        # Llama bench model (compile_times() "compile_attempt_0"), stock and patched alike. A worker is one
        # mode's process, so the setting is this process's (--isolation none: the whole run's).
        torch._dynamo.config.specialize_float = True
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


def _record_padding(result: dict, timed: list[Batch]) -> None:
    real = sum(b.real_tokens for b in timed)
    shaped = sum(b.shaped_tokens for b in timed)
    result["padding_frac"] = round(1 - real / shaped, 4)


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
