"""The benchmark's other runs and tools on small models (seconds, not a measurement): real widths, the results
folder and its history table, the entry point (python -m benchmarks). The cost-table sweeps: test_sweeps.py."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from benchmarks import bars, history, modes
from benchmarks.rounds import run_family
from benchmarks.worker import ModeSpec
from benchmarks.__main__ import main
from compilepack.patching import family_named
from tests.benchmarks.bench_helpers import FakeWorker, measure_mode, result_of
from tests.families import tiny_config

TINY = modes.Workload(tokens_per_step=256, steps=2)
RESULT_KEYS = {"family", "mode", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "compile_s", "compile_cpu_s", "graphs",
               "graph_breaks", "compiles", "peak_mem_mb", "max_logit_diff", "error", "step_s", "timed", "rounds"}
BAR_KEYS = {"family", "bar", "value", "min", "max", "target", "status", "met", "detail"}




# ------------------------------------------------------------------------------------------------ real widths


def test_real_width_configs_are_their_checkpoints_widths_at_one_layer_of_each_kind():
    import torch
    import transformers

    import compilepack
    from benchmarks.configs import bench_config
    from benchmarks.train import resolve_families

    expected = {  # family: (hidden, vocabulary, layer kinds, parameters in millions)
        "llama": (2048, 128256, 1, 323), "qwen3_next": (2048, 151936, 2, 746),
        "qwen3_5": (1024, 248320, 2, 294), "bamba": (4096, 128256, 2, 1547),
    }
    declared = [family.name for family in compilepack.families() if family.fixtures.checkpoint is not None]
    assert sorted(declared) == sorted(expected) == sorted(resolve_families("all", "real"))
    for family, (hidden, vocab, layers, params_m) in expected.items():
        config = bench_config(family, "real")
        assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (hidden, vocab, layers)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert round(sum(p.numel() for p in model.parameters()) / 1e6) == params_m, family
    with pytest.raises(SystemExit, match="--widths real: no config for mamba2"):
        resolve_families("llama,mamba2", "real")


def test_time_split_covers_the_step_and_flops_count_documents_apart(tmp_path):
    from benchmarks import split

    spec = ModeSpec("llama", "patched_packed_eager", TINY, config=tiny_config(family_named("llama")),
                    time_split=True)
    result = measure_mode(spec)
    parts = result["time_split"]
    assert all(parts[k] > 0 for k in ("mixers", "mlp", "lm_head", "optimizer")), parts
    assert sum(parts[k] for k in split.CATEGORIES) == pytest.approx(parts["total"], abs=2e-3)
    assert result["model_gflops_per_s"] > 0 and all(step["model_flops"] > 0 for step in result["timed"])
    # attention FLOPs are per document: two documents of 64 cost half of one of 128 (a padded or mixed count would not)
    model = measure_module_model("llama")
    assert split.attention_flops(model, [64, 64]) * 2 == split.attention_flops(model, [128])
    assert split.step_flops(model, [128]) - split.attention_flops(model, [128]) == 128 * split.linear_flops_per_token(model)


def measure_module_model(family):
    from benchmarks.worker import build_model

    return build_model(family_named(family), tiny_config(family_named(family)), seed=0)


def test_patched_rounds_repeat_their_arrival_step_unless_nothing_is_interleaved(tmp_path):
    """Interleaved with the grouped mode's 3 steps, a patched round trains 3 times on its arrival step; one mode at a
    time (real widths: 10-60 s steps) once, and the report says so."""
    patched, grouped = modes.mode_named("patched_packed_eager"), modes.mode_named("stock_grouped_eager")
    assert [len(r) for r in patched.batches(TINY)[1]] == [len(r) for r in grouped.batches(TINY)[1]] == [3, 3]
    alone = modes.Workload(tokens_per_step=256, steps=2, patched_repeats=1)
    assert [len(r) for r in patched.batches(alone)[1]] == [1, 1]
    assert [len(r) for r in modes.mode_named("stock_packed").batches(TINY)[1]] == [1, 1]
    argv = ["train", "--model", "llama", "--modes", "patched_packed_eager", "--tokens-per-step", "256", "--steps",
            "1", "--warmup", "one-at-a-time", "--no-progress", "--no-plot", "--out", str(tmp_path)]
    assert main(argv) == 0
    (json_path,) = tmp_path.glob("cpu-*.json")
    written = json.loads(json_path.read_text())
    assert written["results"][0]["round_steps"] == [1]
    assert written["settings"]["interleaved"] == "one mode at a time"
    assert written["settings"]["patched_steps_per_round"] == 1


def test_one_at_a_time_finishes_each_mode_before_the_next_starts():
    calls = []
    workers = {m: FakeWorker(m, calls, fail_round=1 if m == "a" else None) for m in "ab"}
    results = run_family(workers, rounds=2, warmup_timeout_s=1, step_timeout_s=1, one_at_a_time=True)
    assert [r["mode"] for r in results] == ["a", "b"]
    assert calls == [("start", "a"), ("ready", "a"), ("round", 0, 0, "a"), ("round", 1, 0, "a"), ("finish", "a"),
                     ("start", "b"), ("ready", "b"), ("round", 0, 0, "b"), ("round", 1, 0, "b"), ("finish", "b")]


def test_the_default_reports_a_known_stock_compile_failure_without_running_it():
    spec = ModeSpec("qwen3_5", "stock_grouped_compiled", TINY, config=tiny_config(family_named("qwen3_5")),
                    skip_known_failures=True)
    result = measure_mode(spec)
    assert result["error"].startswith("RuntimeError: not run: stock torch.compile fails in inductor for qwen3_5")
    assert "InductorError" in result["error"] and result["tokens_per_s"] is None
    entries = bars.evaluate([result, result_of("patched_packed_compiled", [500, 500], family="qwen3_5")])
    compiled = next(b for b in entries if b["bar"] == "patched compiled >= 1.15x stock compiled grouped")
    assert compiled["status"] == "n/a" and "InductorError" in compiled["detail"]


MEASURE_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "measure.py"


def test_keep_freed_memory_stops_the_page_faults_of_large_blocks():
    """glibc mmaps every block over its threshold (32 MB at most) and unmaps it when freed; kept, the second
    allocation of the same size reuses the heap: few page faults instead of one per 4 KB page. Run in a fresh
    process, so this test's process keeps its own allocator."""
    import subprocess

    script = (
        "import importlib.util, resource, torch\n"
        # the module alone, not the compilepack package (whose import of transformers costs seconds)
        f"spec = importlib.util.spec_from_file_location('measure', {str(MEASURE_PATH)!r})\n"
        "measure = importlib.util.module_from_spec(spec); spec.loader.exec_module(measure)\n"
        "def faults():\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for _ in range(4): torch.ones(64 * 2**20 // 4)  # 64 MB, freed at once\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "system = faults()\n"
        "assert measure.keep_freed_memory()\n"
        "for _ in range(4): faults()\n"  # the first kept blocks grow the heap (the aligned blocks split it)
        "print(system, faults())\n"
    )
    system, kept = map(int, subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                           check=True).stdout.split())
    assert system > 4 * 16000 * 0.9  # every 4 KB page of each 64 MB block faulted again
    assert kept < system / 20


# ------------------------------------------------------------------------------------------------ results folder


def test_keep_latest_removes_the_older_runs_of_the_written_kind_only(tmp_path):
    names = ["cpu-2026-12-01-1750.json", "cpu-2026-12-01-1750.md", "cpu-2026-12-01-1750.png", "cpu-2026-12-02.json",
             "cpu-2026-12-03.json", "cpu-real-2026-12-01.json", "long-rows-cpu-2026-12-01.md", "history.csv",
             "notes.md"]
    for name in names:
        (tmp_path / name).write_text("{}")
    removed = history.keep_latest(tmp_path, "cpu-2026-12-02")
    assert removed == ["cpu-2026-12-01-1750.json", "cpu-2026-12-01-1750.md", "cpu-2026-12-01-1750.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - set(removed))  # a later run stays


def test_history_rows_of_a_long_rows_sweep_and_an_op_run():
    figures = lambda tps: {"tokens_per_s": tps, "peak_mem_mb": 1.0, "error": None}  # noqa: E731
    sweep = {"date": "2026-12-01T19:10:54", "torch": "2.13.0", "transformers": "5.24.0",
             "settings": {"doc_len": 256}, "points": [
                 {"family": "qwen3_5", "tokens": 4096, "row": 4096, "documents": "equal", "speedup": 1.15,
                  "modes": {"patched_packed_eager": figures(4740.1), "stock_grouped_eager": figures(4124.7)}},
                 {"family": "qwen3_5", "tokens": 3949, "row": 4096, "documents": "mix", "speedup": 4.74,
                  "modes": {"patched_packed_eager": figures(4566.0), "stock_padded_eager": figures(960.0)}},
                 {"family": "qwen3_5", "tokens": 16384, "documents": "mix", "skipped": "above --padded-max"}]}
    rows = history.rows(sweep, "long-rows-cpu-2026-12-01.json", commit="abc1234")
    assert [(r["kind"], r["mode"], r["tokens"], r["documents"], r["tokens_per_s"], r["vs_stock_grouped_eager"])
            for r in rows] == [
        ("long-rows-cpu", "patched_packed_eager", 4096, "equal 256", 4740.1, 1.15),
        ("long-rows-cpu", "stock_grouped_eager", 4096, "equal 256", 4124.7, 1.0),
        ("long-rows-cpu", "patched_packed_eager", 4096, "mix", 4566.0, ""),  # against stock padded: no grouped ratio
        ("long-rows-cpu", "stock_padded_eager", 4096, "mix", 960.0, "")]
    assert {(r["commit"], r["date"], r["family"], r["file"]) for r in rows} == {
        ("abc1234", "2026-12-01T19:10:54", "qwen3_5", "long-rows-cpu-2026-12-01.json")}
    ops = {"device": "cpu", "date": "2026-11-29T16:43:15", "settings": {"T": 2048, "n_docs": 16}, "results": [
        {"op": "attention", "fwd+bwd": {"stock_ms": 200.0, "packed_ms": 40.0, "speedup": 5.0},
         "batched": {"fwd+bwd": {"stock_ms": 50.0, "packed_ms": 40.0, "speedup": 1.3}}},
        {"op": "mamba2", "error": "ValueError: boom"}]}
    rows = history.rows(ops, "ops-cpu-2026-11-29.json", commit="")
    assert [(r["kind"], r["family"], r["mode"], r["documents"], r["tokens_per_s"], r["vs_stock_grouped_eager"])
            for r in rows] == [
        ("ops-cpu", "attention", "stock", "16 random-length", 10240.0, ""),  # 2048 tokens in 200 ms
        ("ops-cpu", "attention", "packed", "16 random-length", 51200.0, ""),
        ("ops-cpu", "attention", "stock_batched", "16 equal-length", 40960.0, 1.0),
        ("ops-cpu", "attention", "packed", "16 equal-length", 51200.0, 1.3)]  # the per-repeat median, as reported


# ------------------------------------------------------------------------------------------------ entry points


def test_python_m_benchmarks_runs_each_command_and_names_them(capsys):
    from benchmarks import __main__ as entry

    assert entry.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name}" in listed for name in entry.COMMANDS)
    for name, (module, _) in entry.COMMANDS.items():
        assert callable(__import__(module, fromlist=["main"]).main), name
