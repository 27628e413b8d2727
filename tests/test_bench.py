"""Smoke test of the benchmark's plumbing on tiny models (seconds, not a measurement): JSON shape, every mode
present, a mode that fails recorded as an error, a mode past its time limit stopped and recorded."""

from __future__ import annotations

import json

import pytest

from compilepack.bench import modes
from compilepack.bench.worker import ModeSpec, measure_mode
from compilepack.cli import main
from compilepack.patching import family_named
from tests.families import tiny_config

TINY = modes.Workload(tokens_per_step=256, steps=1)
RESULT_KEYS = {"family", "mode", "tokens_per_s", "compile_s", "graphs", "graph_breaks", "compiles", "peak_mem_mb",
               "max_logit_diff", "error"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--model", "llama", "--tokens-per-step", "256", "--steps", "1",
            "--compile-backend", "eager", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    (json_path,) = out.glob("cpu-*.json")
    assert json_path.with_suffix(".md").exists() and json_path.with_suffix(".png").stat().st_size > 0
    return json.loads(json_path.read_text())


def test_report_has_the_documented_shape(report):
    assert report["device"] == "cpu" and report["torch"] and report["transformers"]
    assert [r["mode"] for r in report["results"]] == list(modes.MODE_NAMES)
    for result in report["results"]:
        assert RESULT_KEYS <= set(result), result["mode"]
        assert result["family"] == "llama"
        assert result["error"] is None, result["error"]
        assert result["tokens_per_s"] > 0


def test_figures_are_consistent(report):
    by_mode = {r["mode"]: r for r in report["results"]}
    for mode in ("patched_packed_eager", "patched_packed_compiled", "patched_fixed_compiled"):
        assert by_mode[mode]["max_logit_diff"] < 1e-4  # packed == alone
    assert by_mode["patched_packed_compiled"]["graphs"] == 1
    assert by_mode["patched_packed_compiled"]["graph_breaks"] == 0
    assert all(0 <= r["padding_frac"] < 1 for r in report["results"])
    assert by_mode["patched_packed_eager"]["padding_frac"] == 0  # the HF collator's row has no padding
    assert by_mode["stock_padded_eager"]["speedup_vs"]["stock_padded_eager"] == 1.0
    assert {bar["family"] for bar in report["bars"]} == {"llama"}


def test_a_failing_mode_is_recorded_not_raised():
    # stock Qwen3.5 refuses the HF collator's boundary kwargs without the causal_conv1d CUDA package
    result = measure_mode(ModeSpec("qwen3_5", "stock_packed", TINY, config=tiny_config(family_named("qwen3_5"))))
    assert result["error"].startswith("ValueError") and "causal_conv1d" in result["error"]
    assert result["tokens_per_s"] is None
    assert result["max_logit_diff_position_ids_only"] > 1e-3  # and with position_ids only, it leaks


def test_a_mode_past_its_time_limit_is_stopped_and_recorded():
    from compilepack.bench.isolation import ModeRunner

    spec = ModeSpec("llama", "stock_padded_eager", TINY, config=tiny_config(family_named("llama")))
    result = ModeRunner().run(spec, timeout_s=0.01)
    assert result["error"].startswith("TimeoutError") and result["mode"] == "stock_padded_eager"
