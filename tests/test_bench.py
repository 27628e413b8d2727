"""The benchmark's plumbing on small models (seconds, not a measurement): the report's shape, round-robin rounds
across warm workers, paired ratios and the met / missed / not decided rule, a failing mode recorded, a mode past
its time limit or whose process dies stopped and recorded."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import signal
import sys
import types

import pytest

from benchmarks import bars, history, modes
from benchmarks import report as report_module
from benchmarks.isolation import LocalWorker, ProcessContext
from benchmarks.rounds import round_order, run_family, warm_up_in_lanes
from benchmarks.worker import ModeSpec, measure_mode, summarize_rounds
from benchmarks.__main__ import main
import compilepack
from compilepack import cli
from compilepack.patching import family_named
from tests.families import tiny_config

TINY = modes.Workload(tokens_per_step=256, steps=2)
RESULT_KEYS = {"family", "mode", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "compile_s", "compile_cpu_s", "graphs",
               "graph_breaks", "compiles", "peak_mem_mb", "max_logit_diff", "error", "step_s", "timed", "rounds"}
BAR_KEYS = {"family", "bar", "value", "min", "max", "target", "status", "met", "detail"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["train", "--model", "llama", "--tokens-per-step", "256", "--steps", "2",
            "--compile-backend", "eager", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    (json_path,) = out.glob("cpu-*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    return json.loads(json_path.read_text()), json_path.with_suffix(".md").read_text(), out


def test_report_has_the_documented_shape(report):
    report, _, _ = report
    assert report["device"] == "cpu" and report["torch"] and report["transformers"]
    settings = report["settings"]
    assert settings["steps"] == 2 and settings["mode_set"] == "default"
    assert settings["warmup"] == "compiles-first" and settings["compile_lanes"] >= 1
    assert settings["specialize_float"] is True
    assert settings["modes"] == list(modes.DEFAULT_MODES) == [r["mode"] for r in report["results"]]
    assert set(settings["left_out"]) == {"stock_padded_compiled", "patched_fixed_compiled"}
    assert settings["round_order"] == [list(modes.DEFAULT_MODES), [*modes.DEFAULT_MODES[1:], modes.DEFAULT_MODES[0]]]
    for result in report["results"]:
        assert RESULT_KEYS <= set(result), result["mode"]
        assert result["family"] == "llama" and result["error"] is None, result["error"]
        assert result["tokens_per_s_min"] <= result["tokens_per_s"] <= result["tokens_per_s_max"]
        assert [r["round"] for r in result["rounds"]] == [0, 1]
        # the grouped modes' long, middle and short step; the patched modes' arrival step as many times
        per_round = 3 if result["mode"].startswith(("stock_grouped", "patched")) else 1
        assert len(result["timed"]) == 2 * per_round and result["round_steps"] == [per_round] * 2
        for step in result["timed"]:
            assert step["tokens"] > 0 and step["seconds"] > 0 and step["load_avg"] is not None
    for bar in report["bars"]:
        assert BAR_KEYS <= set(bar) and bar["status"] in ("met", "missed", "not decided", "n/a")
        assert bar["met"] == {"met": True, "missed": False}.get(bar["status"])


def test_markdown_shows_medians_ranges_and_what_was_left_out(report):
    report, markdown, _ = report
    padded = next(r for r in report["results"] if r["mode"] == "stock_padded_eager")
    assert report_module.tokens_cell(padded) in markdown
    assert "[" in report_module.tokens_cell(padded) or padded["tokens_per_s_min"] == padded["tokens_per_s_max"]
    assert "`stock_padded_compiled`" in markdown and "--full" in markdown
    assert "| family | bar | median [min-max] | target | status | decided on | detail |" in markdown
    assert "a bar decided on the median is met or missed by the median alone" in markdown
    grouped = next(b for b in report["bars"] if b["bar"].endswith("stock grouped by length"))
    assert f"| llama | {grouped['bar']} | {report_module.bar_value_cell(grouped)} | 0.95 | " in markdown
    assert "| median |" in markdown


def test_the_run_appends_its_rows_to_the_history_table(report):
    report, _, out = report
    (json_path,) = out.glob("cpu-*.json")
    with (out / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == history.COLUMNS
    assert [row["mode"] for row in rows] == [r["mode"] for r in report["results"]]
    by_mode = {r["mode"]: r for r in report["results"]}
    for row in rows:
        result = by_mode[row["mode"]]
        assert (row["kind"], row["family"], row["file"], row["tokens"]) == ("cpu", "llama", json_path.name, "256")
        assert float(row["tokens_per_s"]) == result["tokens_per_s"]
        assert float(row["vs_stock_grouped_eager"]) == result["speedup_vs"]["stock_grouped_eager"]
    compiled = next(row for row in rows if row["mode"] == "patched_packed_compiled")
    assert "patched compiled no slower than stock grouped by length: " in compiled["bars"]


def test_figures_are_consistent(report):
    report, _, _ = report
    by_mode = {r["mode"]: r for r in report["results"]}
    for mode in ("patched_packed_eager", "patched_packed_compiled"):
        assert by_mode[mode]["max_logit_diff"] < 1e-4  # packed == alone
    assert by_mode["patched_packed_compiled"]["graphs"] == 1
    assert by_mode["patched_packed_compiled"]["graph_breaks"] == 0
    assert all(0 <= r["padding_frac"] < 1 for r in report["results"])
    assert by_mode["patched_packed_eager"]["padding_frac"] == 0  # the HF collator's row has no padding
    assert by_mode["stock_padded_eager"]["speedup_vs"]["stock_padded_eager"] == 1.0
    # rounds are paired on the same documents: round r has the same real tokens in every arrival-order mode's
    # steps (the patched modes train on them 3 times)
    tokens = {mode: {(step["round"], step["tokens"]) for step in by_mode[mode]["timed"]}
              for mode in by_mode if "grouped" not in mode}
    assert len({tuple(sorted(t)) for t in tokens.values()}) == 1 and len(tokens["stock_packed"]) == 2, tokens
    assert [r["tokens"] for r in by_mode["patched_packed_eager"]["rounds"]] == [
        3 * r["tokens"] for r in by_mode["stock_packed"]["rounds"]]
    # the step in round r that ran at position p of the rotated order
    for mode, result in by_mode.items():
        for entry in result["rounds"]:
            assert report["settings"]["round_order"][entry["round"]][entry["position"]] == mode
    compile_bar = next(b for b in report["bars"] if b["bar"].startswith("patched compile time"))
    # the default runs stock compiled grouped (not padded): the compile bar compares against it
    # both compiles' CPU seconds are measured, so the bar compares those (wall time grows with concurrent compiles)
    assert compile_bar["detail"].startswith("patched_packed_compiled vs stock_grouped_compiled compile_cpu_s")
    assert by_mode["patched_packed_compiled"]["compile_cpu_s"] > 0
    assert compile_bar["status"] in ("met", "missed")
    compiled_bar = next(b for b in report["bars"] if b["bar"] == "patched compiled >= 1.15x stock compiled grouped")
    assert compiled_bar["rounds"] >= 1 and compiled_bar["status"] != "n/a"  # a round that recompiled is left out


# ------------------------------------------------------------------------------------------------ rounds


def test_round_robin_visits_every_mode_once_per_round_and_rotates():
    names = ["a", "b", "c", "d", "e"]
    orders = [round_order(names, r) for r in range(7)]
    assert all(sorted(order) == names for order in orders)
    assert [order[0] for order in orders] == ["a", "b", "c", "d", "e", "a", "b"]
    assert orders[1] == ["b", "c", "d", "e", "a"]


class FakeWorker:
    """Records the driver's calls; fails where told."""

    def __init__(self, mode, calls, fail_ready=False, fail_round=None, round_steps=None):
        self.spec, self.result, self.calls = mode, {"mode": mode, "error": None}, calls
        self.fail_ready, self.fail_round, self.round_steps = fail_ready, fail_round, round_steps

    def start(self):
        self.calls.append(("start", self.spec))

    def await_ready(self, timeout_s):
        self.calls.append(("ready", self.spec))
        if self.fail_ready:
            self.result["error"] = "ValueError: refused"
        if self.round_steps:
            self.result["round_steps"] = self.round_steps
        return not self.fail_ready

    def run_round(self, index, position, timeout_s, part=None):
        self.calls.append(("round", index, position, self.spec) + ((part,) if self.round_steps else ()))
        if index == self.fail_round:
            self.result["error"] = "TimeoutError: did not finish round 2"
            return False
        return True

    def finish(self, timeout_s):
        self.calls.append(("finish", self.spec))
        return self.result

    def stop(self):
        pass


def test_driver_warms_every_worker_before_any_round_and_skips_ended_modes():
    calls = []
    workers = {m: FakeWorker(m, calls, fail_ready=m == "b", fail_round=1 if m == "c" else None) for m in "abcd"}
    results = run_family(workers, rounds=3, warmup_timeout_s=1, step_timeout_s=1)
    assert [r["mode"] for r in results] == list("abcd")
    assert calls[:4] == [("start", m) for m in "abcd"]  # concurrent: every worker started before any waiting
    first_round = next(i for i, call in enumerate(calls) if call[0] == "round")
    assert all(call[0] == "ready" for call in calls[4:first_round])
    rounds = [call[1:] for call in calls if call[0] == "round"]
    assert rounds == [(0, 0, "a"), (0, 1, "c"), (0, 2, "d"),  # b never got ready
                      (1, 0, "c"), (1, 1, "d"), (1, 2, "a"),  # c fails in round 1
                      (2, 0, "d"), (2, 1, "a")]
    assert results[1]["error"].startswith("ValueError") and results[2]["error"].startswith("TimeoutError")


def test_rounds_of_several_steps_are_interleaved_step_by_step():
    """A round's steps alternate with the other modes' (the round's order, rotated per round, at every step), so
    the steps a paired ratio compares lie side by side in time; a mode with fewer steps drops out early."""
    calls = []
    workers = {"one": FakeWorker("one", calls, round_steps=[1, 1]),
               "three": FakeWorker("three", calls, round_steps=[3, 3]),
               "also3": FakeWorker("also3", calls, round_steps=[3, 3])}
    run_family(workers, rounds=2, warmup_timeout_s=1, step_timeout_s=1)
    steps = [(call[1], call[3], call[4]) for call in calls if call[0] == "round"]
    assert steps == [(0, "one", 0), (0, "three", 0), (0, "also3", 0), (0, "three", 1), (0, "also3", 1),
                     (0, "three", 2), (0, "also3", 2),
                     (1, "three", 0), (1, "also3", 0), (1, "one", 0), (1, "three", 1), (1, "also3", 1),
                     (1, "three", 2), (1, "also3", 2)]
    positions = {(call[1], call[3]): call[2] for call in calls if call[0] == "round"}
    assert positions == {(0, "one"): 0, (0, "three"): 1, (0, "also3"): 2,
                         (1, "three"): 0, (1, "also3"): 1, (1, "one"): 2}


def test_a_mode_failing_inside_an_interleaved_round_runs_no_further_step():
    calls, done = [], []
    workers = {"a": FakeWorker("a", calls, round_steps=[3, 3], fail_round=0), "b": FakeWorker("b", calls, round_steps=[3, 3])}
    run_family(workers, rounds=2, warmup_timeout_s=1, step_timeout_s=1, on_done=lambda mode, what: done.append((mode, what)))
    assert [call[3] for call in calls if call[0] == "round" and call[3] == "a"] == ["a"]  # its first step failed
    assert [call for call in calls if call[0] == "round" and call[3] == "b"][-1][1] == 1  # b ran both rounds
    assert done == [("a", "ready"), ("b", "ready"), ("a", "ended"), ("b", "round"), ("b", "round")]


def test_compiles_warm_up_in_lanes_in_order_and_a_failed_one_frees_its_lane():
    calls, done = [], []
    workers = {key: FakeWorker(key, calls, fail_ready=key == "b") for key in "abcde"}
    ready = warm_up_in_lanes(workers, lanes=2, warmup_timeout_s=1, on_done=lambda key, what: done.append((key, what)))
    assert ready == {"a": True, "b": False, "c": True, "d": True, "e": True}
    # never more than two started and not yet waited for; each next one starts once the earliest is known
    assert calls == [("start", "a"), ("start", "b"), ("ready", "a"), ("start", "c"), ("ready", "b"),
                     ("start", "d"), ("ready", "c"), ("start", "e"), ("ready", "d"), ("ready", "e")]
    assert done == [("a", "ready"), ("b", "ended"), ("c", "ready"), ("d", "ready"), ("e", "ready")]


def test_a_family_with_warm_workers_starts_and_waits_for_the_others_only():
    calls = []
    workers = {m: FakeWorker(m, calls) for m in "abc"}
    run_family(workers, rounds=1, warmup_timeout_s=1, step_timeout_s=1, warm={"b": True, "c": False})
    assert [call for call in calls if call[0] in ("start", "ready")] == [("start", "a"), ("ready", "a")]
    assert [call[3] for call in calls if call[0] == "round"] == ["a", "b"]  # c did not get ready: no round
    assert [call[1] for call in calls if call[0] == "finish"] == ["a", "b", "c"]


def test_serial_warmup_starts_each_worker_after_the_previous_one_is_ready():
    calls = []
    run_family({m: FakeWorker(m, calls) for m in "ab"}, rounds=1, warmup_timeout_s=1, step_timeout_s=1,
               concurrent=False)
    assert calls[:4] == [("start", "a"), ("ready", "a"), ("start", "b"), ("ready", "b")]


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_warm_workers_run_their_rounds_in_turn(isolation, tmp_path):
    workload = modes.Workload(tokens_per_step=128, steps=2)
    make = ProcessContext().worker if isolation == "process" else LocalWorker
    names = ["stock_padded_eager", "patched_packed_eager"]
    workers = {name: make(ModeSpec("llama", name, workload, config=tiny_config(family_named("llama")),
                                   log_path=str(tmp_path / f"{name}.log"))) for name in names}
    results = run_family(workers, rounds=2, warmup_timeout_s=120, step_timeout_s=120)
    positions = {r["mode"]: [(step["round"], step["position"]) for step in r["timed"]] for r in results}
    # the patched mode trains on its round's arrival step as many times as the grouped mode has steps (3)
    assert positions == {"stock_padded_eager": [(0, 0), (1, 1)],
                         "patched_packed_eager": [(0, 1)] * 3 + [(1, 0)] * 3}
    assert [r["round_steps"] for r in results] == [[1, 1], [3, 3]]
    assert all(r["error"] is None and r["tokens_per_s"] > 0 and r["peak_mem_mb"] is not None for r in results)
    assert len(bars.paired_ratios(results[1], results[0])) == 2


# ------------------------------------------------------------------------------------------------ paired ratios


def _result(mode, per_round, family="llama", compiled=()):
    timed = [{"round": r, "position": 0, "tokens": 1000, "seconds": 1000 / tps, "load_avg": 1.0,
              "compiled": r in compiled} for r, tps in enumerate(per_round) if tps]
    return {"family": family, "mode": mode, "error": None, **summarize_rounds(timed)}


def test_summary_is_the_median_of_rounds_without_compiles():
    result = _result("patched_packed_compiled", [100, 400, 300, 200], compiled={0})
    assert (result["tokens_per_s"], result["tokens_per_s_min"], result["tokens_per_s_max"]) == (300, 200, 400)
    assert not result["steady"]
    grouped = summarize_rounds([{"round": 0, "position": 1, "tokens": t, "seconds": s, "load_avg": 0.5,
                                 "compiled": False} for t, s in ((600, 2.0), (300, 0.5), (100, 0.5))])
    assert grouped["rounds"][0]["tokens"] == 1000 and grouped["tokens_per_s"] == 333.3  # 1000 tokens in 3 s


def test_the_compile_bar_compares_cpu_seconds_when_both_compiles_have_them():
    def compile_bar(patched: dict, stock: dict) -> dict:
        results = [dict(_result("patched_packed_compiled", [1000]), **patched),
                   dict(_result("stock_grouped_compiled", [1000]), **stock)]
        return next(b for b in bars.evaluate(results) if b["bar"].startswith("patched compile time"))

    # the patched compile shared the cores longer (wall 60 s against 40 s) but used less CPU: met on CPU seconds
    both = compile_bar({"compile_s": 60.0, "compile_cpu_s": 30.0}, {"compile_s": 40.0, "compile_cpu_s": 40.0})
    assert both["value"] == 0.75 and both["status"] == "met" and "compile_cpu_s" in both["detail"]
    # a report without CPU seconds (an older one, or a worker that could not read them) compares wall time
    wall = compile_bar({"compile_s": 60.0, "compile_cpu_s": None}, {"compile_s": 40.0, "compile_cpu_s": 40.0})
    assert wall["value"] == 1.5 and wall["status"] == "missed" and "compile_s" in wall["detail"]


def test_compile_cpu_seconds_are_the_first_step_beyond_its_tokens_at_the_steady_rate():
    from benchmarks.worker import _compile_cpu_s

    batch = lambda tokens: types.SimpleNamespace(real_tokens=tokens)  # noqa: E731
    records = [(batch(500), 30.0, True), (batch(1000), 1.0, False), (batch(1000), 1.2, True), (batch(2000), 2.0, False)]
    # steady CPU is 2 s per 1000 tokens (the recompiled step is left out): 500 tokens cost 1 s of the first 41 s
    assert _compile_cpu_s(records, [41.0, 2.0, 9.0, 4.0]) == 40.0
    assert _compile_cpu_s(records[:1], [41.0]) is None  # no steady step to subtract


def test_paired_ratios_divide_round_by_round():
    # medians alone would say 2.0; the pairs say 1.5, 3, 2: a slow round slows both sides
    patched = _result("patched_packed_eager", [300, 600, 800])
    padded = _result("stock_padded_eager", [200, 200, 400])
    assert bars.paired_ratios(patched, padded) == [1.5, 3.0, 2.0]
    # only rounds both measured, only rounds that did not compile
    partial = _result("stock_padded_eager", [200, 0, 400])
    compiled = _result("patched_packed_compiled", [900, 600, 800], compiled={0})
    assert bars.paired_ratios(compiled, partial) == [2.0]


def test_a_bar_whose_rounds_straddle_the_target_is_not_decided():
    def grouped(patched: list[float]) -> dict:  # a hybrid's grouped bar: decided in every round
        return next(b for b in bars.evaluate([_result("patched_packed_eager", patched, family="bamba"),
                                              _result("stock_grouped_eager", [1000, 1000, 1000], family="bamba")])
                    if "grouped" in b["bar"])

    entry = grouped([1200, 1100, 1000])
    assert (entry["value"], entry["min"], entry["max"]) == (1.1, 1.0, 1.2)
    assert entry["status"] == "not decided" and entry["met"] is None
    # the same median, but above the target in a round and below it in none: here the spreads decide
    met = grouped([1200, 1160, 1150])
    assert met["status"] == "met" and met["met"] is True
    missed = grouped([1140, 1000, 900])
    assert missed["status"] == "missed" and missed["met"] is False


def test_status_rule_at_the_edges():
    assert bars.status(1.15, 1.3, 1.15) == "met"
    assert bars.status(1.0, 1.1499, 1.15) == "missed"
    assert bars.status(1.1, 1.2, 1.15) == "not decided"
    assert bars.status(0.8, 0.9, 1.0, higher_is_better=False) == "met"  # compile time: lower is better
    assert bars.status(1.1, 1.1, 1.0, higher_is_better=False) == "missed"


def test_patched_packed_is_the_better_median_and_its_own_rounds_are_paired():
    results = [_result("stock_padded_eager", [100, 100, 50]),
               _result("patched_packed_eager", [450, 600, 400]),
               _result("patched_packed_compiled", [700, 400, 300])]  # median 400 < eager's 450
    entry = next(b for b in bars.evaluate(results) if "5x" in b["bar"])
    assert entry["detail"].startswith("patched_packed_eager vs stock_padded_eager")
    assert entry["ratios"] == [4.5, 6.0, 8.0] and entry["status"] == "not decided" and entry["value"] == 6.0
    compiled_bar = next(b for b in bars.evaluate(results)
                        if b["bar"] == "patched compiled no slower than patched eager")
    assert compiled_bar["ratios"] == pytest.approx([700 / 450, 400 / 600, 300 / 400], abs=1e-3)


def test_the_grouped_bar_is_patched_compiled_even_where_eager_has_the_higher_median():
    # eager's median (1200) beats compiled's (1160), and eager's rounds all clear 1.15; compiled's second does not
    results = [_result("stock_grouped_eager", [1000, 1000, 1000], family="qwen3_next"),
               _result("patched_packed_eager", [1200, 1200, 1200], family="qwen3_next"),
               _result("patched_packed_compiled", [1300, 1100, 1160], family="qwen3_next")]
    grouped = next(b for b in bars.evaluate(results) if b["bar"].endswith("stock grouped by length"))
    assert grouped["bar"] == "patched compiled >= 1.15x stock grouped by length"
    assert grouped["detail"].startswith("patched_packed_compiled vs stock_grouped_eager")
    assert grouped["ratios"] == [1.3, 1.1, 1.16] and grouped["status"] == "not decided"
    # a compiled mode that failed leaves the bar n/a with its error, never decided by the eager mode instead
    failed = dict(_result("patched_packed_compiled", [], family="qwen3_next"), error="InductorError: boom")
    grouped = next(b for b in bars.evaluate(results[:2] + [failed]) if b["bar"].endswith("stock grouped by length"))
    assert grouped["status"] == "n/a" and "InductorError: boom" in grouped["detail"]
    # a run without the compiled mode says which mode its bar is
    grouped = next(b for b in bars.evaluate(results[:2]) if b["bar"].endswith("stock grouped by length"))
    assert grouped["bar"] == "patched eager >= 1.15x stock grouped by length" and grouped["status"] == "met"


def _grouped_bar(family: str, patched: list[float], mode: str = "patched_packed_compiled") -> dict:
    results = [_result("stock_grouped_eager", [1000] * len(patched), family=family),
               _result(mode, patched, family=family)]
    return next(b for b in bars.evaluate(results) if b["bar"].endswith("stock grouped by length"))


def test_an_attention_only_family_is_no_slower_than_stock_grouped_by_the_median():
    """An attention-only model's grouped batches pad ~3%, so packing can win little: its bar is "no slower" (the
    median paired ratio >= 0.95), on the median, so one slow round does not sink it nor one fast round carry it."""
    slow_round = _grouped_bar("llama", [1000, 900, 1050])  # paired ratios 1.0, 0.9, 1.05
    assert slow_round["bar"] == "patched compiled no slower than stock grouped by length"
    assert (slow_round["value"], slow_round["min"], slow_round["max"], slow_round["target"]) == (1.0, 0.9, 1.05, 0.95)
    assert (slow_round["status"], slow_round["met"], slow_round["rule"]) == ("met", True, "median")
    slower = _grouped_bar("llama", [900, 850, 1000])  # median 0.9; its best round reaches 1.0
    assert (slower["value"], slower["max"], slower["status"], slower["met"]) == (0.9, 1.0, "missed", False)
    eager_only = _grouped_bar("llama", [1000, 960, 940], mode="patched_packed_eager")  # a run without compiled
    assert eager_only["bar"] == "patched eager no slower than stock grouped by length"
    assert eager_only["status"] == "met"


def test_a_hybrid_family_keeps_1_15x_stock_grouped_in_every_round():
    entry = _grouped_bar("qwen3_5", [1200, 1200, 1100])  # median 1.2, one round at 1.1
    assert entry["bar"] == "patched compiled >= 1.15x stock grouped by length"
    assert (entry["value"], entry["min"], entry["target"], entry["rule"]) == (1.2, 1.1, 1.15, "every round")
    assert entry["status"] == "not decided" and entry["met"] is None
    assert _grouped_bar("qwen3_next", [1160, 1300, 1150])["status"] == "met"
    assert _grouped_bar("bamba", [1100, 1140, 1000])["status"] == "missed"


def test_the_grouped_rule_is_the_family_declaration_not_its_name():
    assert bars.attention_only("llama") is family_named("llama").stock_packs_positions is True
    assert not any(bars.attention_only(name) for name in ("qwen3_next", "qwen3_5", "bamba"))
    assert {family.stock_packs_positions for family in compilepack.families()} == {True, False}
    bars_source = (pathlib.Path(bars.__file__)).read_text()
    assert not any(f'"{family.name}"' in bars_source for family in compilepack.families())


def test_llama_also_needs_1_15x_stock_compiled_grouped_in_every_round():
    def llama_bars(compiled: list[float]) -> dict[str, dict]:
        results = [_result("stock_grouped_eager", [1000, 1000, 1000]),
                   _result("stock_grouped_compiled", [1000, 1000, 1000]),
                   _result("patched_packed_compiled", compiled)]
        return {b["bar"]: b for b in bars.evaluate(results)}

    entries = llama_bars([1200, 1300, 1100])
    assert entries["patched compiled no slower than stock grouped by length"]["status"] == "met"
    compiled = entries["patched compiled >= 1.15x stock compiled grouped"]
    assert compiled["detail"].startswith("patched_packed_compiled vs stock_grouped_compiled, 3 paired rounds")
    assert (compiled["value"], compiled["min"], compiled["rule"]) == (1.2, 1.1, "every round")
    assert compiled["status"] == "not decided"  # its median would say met: every round decides
    assert llama_bars([1200, 1300, 1160])["patched compiled >= 1.15x stock compiled grouped"]["status"] == "met"


def test_a_missing_mode_makes_its_bars_not_applicable():
    entries = bars.evaluate([_result("patched_packed_eager", [500, 500])])
    grouped = next(b for b in entries if "grouped" in b["bar"])
    assert grouped["status"] == "n/a" and grouped["met"] is None and "stock_grouped_eager not run" in grouped["detail"]


# ------------------------------------------------------------------------------------------------ failures


def test_a_failing_mode_is_recorded_not_raised():
    # stock Qwen3.5 refuses the HF collator's boundary kwargs without the causal_conv1d CUDA package
    result = measure_mode(ModeSpec("qwen3_5", "stock_packed", TINY, config=tiny_config(family_named("qwen3_5"))))
    assert result["error"].startswith("ValueError") and "causal_conv1d" in result["error"]
    assert result["tokens_per_s"] is None and result["rounds"] == []
    assert result["max_logit_diff_position_ids_only"] > 1e-3  # and with position_ids only, it leaks


def _process_worker(tmp_path, mode="stock_padded_eager"):
    spec = ModeSpec("llama", mode, TINY, config=tiny_config(family_named("llama")), log_path=str(tmp_path / "w.log"))
    worker = ProcessContext().worker(spec)
    worker.start()
    return worker


def test_a_mode_past_its_warmup_limit_is_stopped_and_recorded(tmp_path):
    worker = _process_worker(tmp_path)
    assert not worker.await_ready(timeout_s=0.01)
    assert worker.result["error"].startswith("TimeoutError: did not finish getting ready within 0 s (during ")
    assert worker.result["mode"] == "stock_padded_eager" and not worker._process.is_alive()


def test_a_mode_past_its_step_limit_is_stopped_with_what_it_measured(tmp_path):
    worker = _process_worker(tmp_path)
    assert worker.await_ready(timeout_s=120)
    assert worker.run_round(0, 0, timeout_s=120)
    assert not worker.run_round(1, 0, timeout_s=0.001)  # no training step answers within a millisecond
    result = worker.finish(timeout_s=120)
    assert result["error"].startswith("TimeoutError: did not finish round 2 within 0 s (during round 2")
    assert [r["round"] for r in result["rounds"]] == [0] and result["tokens_per_s"] > 0
    assert not worker._process.is_alive()


def test_a_dying_worker_is_recorded(tmp_path):
    worker = _process_worker(tmp_path)
    assert worker.await_ready(timeout_s=120)
    os.kill(worker._process.pid, signal.SIGKILL)
    assert not worker.run_round(0, 0, timeout_s=120)
    assert worker.result["error"].startswith("the mode's process died (exit code -9)")


def test_an_interrupted_run_stops_waiting_workers_at_once(tmp_path):
    import time

    worker = _process_worker(tmp_path)
    assert worker.await_ready(timeout_s=120)
    started = time.monotonic()
    worker.stop()  # what run_family's finally does when the run is interrupted: no result is coming
    assert time.monotonic() - started < 5 and not worker._process.is_alive()


def test_grouped_rounds_take_a_long_a_middle_and_a_short_step_snake_wise():
    from benchmarks import data

    workload = modes.Workload(tokens_per_step=256, steps=3)
    pool = workload._steps(workload.warmup_steps + workload.group_pool)[workload.warmup_steps :]
    positions = data.evenly_spaced(data.grouped_by_length(pool, 256), 9)  # longest documents first
    rounds = workload.grouped_rounds()
    assert [[positions.index(step) for step in steps] for steps in rounds] == [[0, 5, 6], [1, 4, 7], [2, 3, 8]]
    one_round = modes.Workload(tokens_per_step=256, steps=1)
    pool = one_round._steps(one_round.warmup_steps + one_round.group_pool)[one_round.warmup_steps :]
    assert one_round.grouped_rounds() == [data.evenly_spaced(data.grouped_by_length(pool, 256), 3)]


@pytest.mark.parametrize("mode", modes.MODE_NAMES)
def test_modes_warm_up_on_a_full_step_of_their_own_layout(mode):
    """A warm-up smaller than the timed steps leaves the first timed round paying the first full-size step (an
    eager mode's round 0 took up to 1.26x its later rounds with a 1k-token warm-up). Stock padded eager is the
    documented exception (its full step would slow the family's compile beside it)."""
    workload = modes.Workload(tokens_per_step=4096, steps=1)
    warmup, _ = modes.mode_named(mode).batches(workload)
    warmup_docs = [batch.docs for batch in warmup]
    if mode == "stock_padded_eager":
        assert sum(len(doc) for doc in warmup_docs[0]) <= modes.PADDED_EAGER_WARMUP_TOKENS
    elif mode in ("stock_grouped_eager", "stock_grouped_compiled"):
        assert warmup_docs == workload.grouped_warmup()
        longest = max(len(doc) for steps in workload.grouped_rounds() for step in steps for doc in step)
        assert min(len(doc) for doc in warmup_docs[0]) >= longest  # the pool's longest documents
    else:
        assert warmup_docs == workload.arrival_steps()[0]
        assert sum(len(doc) for doc in warmup_docs[0]) > 2048  # a full step (the old eager warm-up: 1k tokens)


# ------------------------------------------------------------------------------------------------ dependencies


def test_a_missing_required_package_stops_the_run_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--model", "llama", "--no-progress", "--out", str(out)])
    message = str(stopped.value)
    assert "psutil: peak memory" in message and "pip install psutil" in message and '".[bench]"' in message
    assert not out.exists()  # stopped before the output folder, the workers or any model


def test_without_matplotlib_the_run_skips_the_plot_warns_and_exits_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["train", "--model", "llama", "--modes", "patched_packed_eager", "--tokens-per-step", "128", "--steps", "1",
            "--isolation", "none", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.index("warning: matplotlib is not installed") < printed.index("patched_packed_eager")  # first
    assert "pip install matplotlib" in printed and "no .png" in printed
    (json_path,) = tmp_path.glob("cpu-*.json")
    assert json_path.with_suffix(".md").exists() and not json_path.with_suffix(".png").exists()


# ------------------------------------------------------------------------------------------------ real widths


def test_real_width_configs_are_their_checkpoints_widths_at_one_layer_of_each_kind():
    import torch
    import transformers

    import compilepack
    from benchmarks.configs import bench_config
    from benchmarks.main import resolve_families

    expected = {  # family: (hidden, vocabulary, layer kinds, parameters in millions)
        "llama": (2048, 128256, 1, 323), "qwen3_next": (2048, 151936, 2, 746),
        "qwen3_5": (1024, 248320, 2, 294), "bamba": (4096, 128256, 2, 1547),
    }
    declared = [family.name for family in compilepack.families() if family.checkpoint is not None]
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


def test_long_rows_batches_the_same_documents_each_mode_its_way():
    from benchmarks import long_rows

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


def test_the_default_reports_a_known_stock_compile_failure_without_running_it():
    spec = ModeSpec("qwen3_5", "stock_grouped_compiled", TINY, config=tiny_config(family_named("qwen3_5")),
                    skip_known_failures=True)
    result = measure_mode(spec)
    assert result["error"].startswith("RuntimeError: not run: stock torch.compile fails in inductor for qwen3_5")
    assert "InductorError" in result["error"] and result["tokens_per_s"] is None
    entries = bars.evaluate([result, _result("patched_packed_compiled", [500, 500], family="qwen3_5")])
    compiled = next(b for b in entries if b["bar"] == "patched compiled >= 1.15x stock compiled grouped")
    assert compiled["status"] == "n/a" and "InductorError" in compiled["detail"]


MEASURE_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "measure.py"


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


def test_a_long_rows_sweep_appends_its_rows_and_keeps_only_the_latest_sweep(tmp_path):
    from benchmarks import long_rows

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


# ------------------------------------------------------------------------------------------------ entry points


def test_compilepack_bench_is_a_deprecated_pointer_to_python_m_benchmarks(tmp_path, monkeypatch, capsys):
    """From a checkout, ``python -m compilepack bench`` says the new command in one line and runs it with the same
    options (a child process: the library does not import its benchmark); from an installed wheel, which has no
    benchmarks/ folder beside the package, it says where the benchmark lives and exits 2."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "compilepack", "bench", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, check=True)
    assert done.stderr.strip().splitlines() == [
        "compilepack bench is deprecated: run `python -m benchmarks` from the checkout (same options)."]
    assert done.stdout.startswith("usage: python -m benchmarks") and "--widths" in done.stdout
    monkeypatch.setattr(cli, "CHECKOUT", tmp_path)  # as installed: no benchmarks/ beside the package
    assert cli.main(["bench", "--model", "llama"]) == 2
    assert "benchmarks/ folder of the compilepack repository" in capsys.readouterr().err


def test_python_m_benchmarks_runs_each_command_and_names_them(capsys):
    from benchmarks import __main__ as entry

    assert entry.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name}" in listed for name in entry.COMMANDS)
    for name, (module, _) in entry.COMMANDS.items():
        assert callable(__import__(module, fromlist=["main"]).main), name
