"""The cost-table sweeps (``python -m tools.sweeps``): their entry point and the pointer left in the benchmark's,
``long-rows``' documents and files, and a ``trainer-rows`` point that does not fit, stopped and reported as out of
memory (not a crash of the sweep)."""

from __future__ import annotations

import csv
import math
import pathlib
import re

import pytest

from benchmarks import modes
from tools.sweeps import long_rows, trainer_rows

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_python_m_tools_sweeps_names_each_sweep_and_the_benchmark_points_to_it(capsys):
    from benchmarks import __main__ as benchmark
    from tools.sweeps import __main__ as sweeps

    assert sweeps.main(["--help"]) == 0 and sweeps.main([]) == 2
    listed = capsys.readouterr().out
    for name, (module, _) in sweeps.COMMANDS.items():
        assert f"  {name}" in listed and callable(__import__(module, fromlist=["main"]).main), name
        assert benchmark.main([name]) == 2  # moved: a pointer, not a run
        assert f"run `python -m tools.sweeps {name}`" in capsys.readouterr().err
    assert set(sweeps.COMMANDS) == set(benchmark.MOVED)


def test_the_benchmark_never_imports_the_sweeps():
    """tools/sweeps/ imports benchmarks/ (rounds, workers, the results folder); benchmarks/ imports nothing of it (no
    cycle: the benchmark's only import of tools/ is gpu_check.py, the GPU check's entry)."""
    imports = re.compile(r"^\s*(from|import)\s+tools\.sweeps\b|[\"']tools\.sweeps\.", re.M)
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "benchmarks").rglob("*.py")
                 if imports.search(path.read_text())]
    assert offenders == []


def test_long_rows_batches_the_same_documents_each_mode_its_way():
    docs = long_rows.equal_documents(512, 128)
    assert [len(doc) for doc in docs] == [128] * 4
    workload = modes.Workload(tokens_per_step=512, steps=2)
    _, grouped = modes.mode_named("stock_grouped_eager").batches_of(docs, workload)
    _, packed = modes.mode_named("patched_packed_eager").batches_of(docs, workload)
    assert len(grouped) == len(packed) == 2  # one round per timed step, the same documents in each
    assert grouped[0][0].tensors["input_ids"].shape == (4, 128)  # equal documents: no padding at all
    assert packed[1][0].tensors["input_ids"].shape == (1, 512) and packed[1][0].docs == docs
    mix = long_rows.mixed_documents(2048)
    assert sum(map(len, mix)) <= 2048 and len(set(map(len, mix))) > 5
    with pytest.raises(SystemExit, match="not a multiple of --doc-len 100"):
        long_rows.equal_documents(512, 100)


def test_a_long_rows_sweep_appends_its_rows_and_keeps_only_the_latest_sweep(tmp_path):
    (tmp_path / "long-rows-cpu-2026-01-01.json").write_text("{}")
    sweep = {"date": "2026-12-01T19:10:54", "torch": "2.13.0", "transformers": "5.24.0", "wall_s": 1.0,
             "load_avg": {"start": 1.0, "end": 1.0},
             "settings": {"widths": "bench", "steps": 2, "allocator": "keep", "threads": 1, "doc_len": 256},
             "points": [{"family": "qwen3_5", "tokens": 512, "row": 512, "documents": "equal", "n_docs": 2,
                         "speedup": 1.1, "speedup_range": [1.0, 1.2], "modes": {
                             mode: {"tokens_per_s": 100.0, "tokens_per_s_min": 90.0, "tokens_per_s_max": 110.0,
                                    "peak_mem_mb": 1.0, "padding_frac": 0.0}
                             for mode in ("patched_packed_eager", "stock_grouped_eager")}}]}
    long_rows.write(sweep, tmp_path, "long-rows-cpu-2026-12-01", can_plot=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "history.csv", "long-rows-cpu-2026-12-01.json", "long-rows-cpu-2026-12-01.md"]
    with (tmp_path / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["kind"], r["mode"], r["vs_stock_grouped_eager"]) for r in rows] == [
        ("long-rows-cpu", "patched_packed_eager", "1.1"), ("long-rows-cpu", "stock_grouped_eager", "1.0")]


def test_a_point_past_the_memory_limit_is_reported_out_of_memory(monkeypatch):
    monkeypatch.chdir(ROOT)
    point = {"trainer": "hf", "family": "qwen3_5", "tokens": 4096, "mode": "stock", "docs": 8, "warmup": 0,
             "steps": 1, "compile": False}
    # a limit the point passes early (Qwen3.5-0.8B widths: the weights alone are 1.2 GB), so the test stays short
    result = trainer_rows._run_point(point, limit_gb=0.5, timeout=300)
    assert result["status"] == "out of memory" and result["peak_gb"] >= 0.5, result  # stopped past 0.5, rounded
    report = {"date": "today", "settings": {"families": "qwen3_5", "rows": "4096"}, "measurements": [
        {**point, **result},
        {**point, "mode": "chunked", "status": "ok", "tokens_per_s": 12.5, "peak_gb": 6.1,
         "shares": dict.fromkeys(trainer_rows.PARTS, 0.2)},
    ]}
    table = trainer_rows.markdown(report)
    assert "| hf | qwen3_5 | 4,096 | stock | out of memory | > 0.5 |" in table
    assert "| hf | qwen3_5 | 4,096 | chunked | 12.5 | 6.1 | 20% | 20% | 20% | 20% | 20% |" in table


def test_cp_memory_narrow_keeps_the_mixers_release_widths_and_says_so():
    """``--narrow`` cuts only the vocabulary and the MLP: every mixer weight keeps its release shape, and every output
    names the point as narrow (a reader never takes it for the release)."""
    import torch
    import transformers

    from tools.sweeps import cp_memory

    def shapes(narrow: bool) -> dict:
        config = cp_memory.config_of({"family": "bamba", "narrow": narrow})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        return {name: tuple(p.shape) for name, p in model.named_parameters()}

    release, narrow = shapes(False), shapes(True)
    mixers = [name for name in release if ".mamba." in name or ".self_attn." in name]
    assert mixers and all(narrow[name] == release[name] for name in mixers)
    assert narrow["lm_head.weight"] == (cp_memory.NARROW_VOCAB, release["lm_head.weight"][1])
    parameters = lambda shapes: sum(map(math.prod, shapes.values()))  # noqa: E731
    assert parameters(narrow) < parameters(release) / 3  # 0.43 B against 1.55 B
    point = {"family": "bamba", "narrow": True, "tokens": 8192, "world": 2, "head": "chunked", "status": "ok",
             "peak_gb": 5.0, "model_gb": 2.0, "predicted_mixers_gb": 0.5, "step_s": 10.0}
    assert "| bamba (narrow) |" in cp_memory.markdown({"measurements": [point]})
    assert cp_memory._line(point).startswith("bamba (narrow)")
