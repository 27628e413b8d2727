"""``python -m benchmarks trainer-rows``: a point that does not fit is stopped and reported as out of memory (not a
crash of the sweep), and the report's table says so."""

from __future__ import annotations

import pathlib

import pytest

trainer_rows = pytest.importorskip("benchmarks.trainer_rows", reason="runs from a checkout (benchmarks/)")

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
