"""The benchmark's parts on small models (seconds, not a measurement): the model FLOPs, a known stock failure
reported without running it, the allocator, the results folder, the entry point (python -m benchmarks)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from benchmarks import bars, history, modes
from benchmarks.worker import ModeSpec
from compilepack.patching import family_named
from tests.benchmarks.bench_helpers import measure_mode, result_of
from tests.families import tiny_config

TINY = modes.Workload(tokens_per_step=256, steps=2)


def test_flops_count_documents_apart_and_every_trained_weight(tmp_path):
    from benchmarks.flops import step_flops
    from benchmarks.worker import build_model

    model = build_model(family_named("llama"), tiny_config(family_named("llama")), seed=0)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = step_flops(model, [128]) - 128 * 6 * linear
    # causal attention is per document: two documents of 64 cost half of one of 128 (a padded or mixed count would not)
    assert attention > 0 and step_flops(model, [64, 64]) - 128 * 6 * linear == attention / 2
    model.lm_head.weight.requires_grad_(False)  # a frozen weight: no weight gradient, 4 FLOPs per weight and token
    assert step_flops(model, [128]) == pytest.approx(128 * (6 * linear - 2 * model.lm_head.weight.numel()) + attention)
    result = measure_mode(ModeSpec("llama", "patched_packed_eager", TINY, config=tiny_config(family_named("llama"))))
    assert result["model_gflops_per_s"] > 0 and all(step["model_flops"] > 0 for step in result["timed"])


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


# ------------------------------------------------------------------------------------------------ entry points


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_python_m_benchmarks_is_the_train_command_named_or_not(argv, capsys):
    from benchmarks import __main__ as entry

    with pytest.raises(SystemExit) as exited:
        entry.main(argv)
    assert exited.value.code == 0 and "--tokens-per-step" in capsys.readouterr().out
