"""The op benchmark (``python -m benchmarks ops``) runs end to end on tiny sizes, and its second comparison
is a correctness cross-check: packed on equal-length documents equals the stock function on their batch."""

import csv
import json

import pytest

from benchmarks import ops as op_bench

OPS = "attention,causal_conv1d,gated_delta_rule,mamba2,kimi_delta_attention"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ops")
    (out / "ops-cpu-2000-01-01.json").write_text("{}")  # an older run of the same kind
    args = ["--ops", OPS, "--T", "96", "--n-docs", "4", "--repeats", "1", "--warmup", "0", "--threads", "1",
            "--out", str(out)]
    assert op_bench.main(args) == 0
    return out


@pytest.fixture(scope="module")
def report(run):
    return json.loads(max(run.glob("ops-cpu-*.json")).read_text())  # this run's: the latest date


def test_the_run_appends_to_the_history_table_and_replaces_the_older_run(run, report):
    """The op as the family, each implementation as a mode: stock and packed on the packed row, stock on the batch
    of equal documents and packed on their row; tokens/s are the row's tokens over the forward+backward time."""
    assert not (run / "ops-cpu-2000-01-01.json").exists()
    with (run / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["family"], row["mode"]) for row in rows] == [
        (op, mode) for op in OPS.split(",") for mode in ("stock", "packed", "stock_batched", "packed")]
    attention = next(result for result in report["results"] if result["op"] == "attention")
    stock, packed, batched, packed_equal = rows[:4]
    assert float(stock["tokens_per_s"]) == round(96 * 1e3 / attention["fwd+bwd"]["stock_ms"], 3)
    assert float(packed_equal["vs_stock_grouped_eager"]) == attention["batched"]["fwd+bwd"]["speedup"]
    assert {row["kind"] for row in rows} == {"ops-cpu"} and stock["documents"] == "4 random-length"


def test_every_op_has_both_comparisons(report):
    rows = {row["op"]: row for row in report["results"]}
    assert sorted(rows) == sorted(OPS.split(","))
    for row in rows.values():
        assert row["error"] is None, row
        for figures in (row, row["batched"]):
            for pass_name in ("fwd", "fwd+bwd"):
                assert figures[pass_name]["stock_ms"] > 0 and figures[pass_name]["packed_ms"] > 0


def test_packed_equals_stock_on_the_batch_of_the_same_documents(report):
    """Both sides are correct here, so they agree to fp32 rounding; the stock function on the packed row (no
    boundaries) is the control: it mixes documents, and misses by far."""
    for row in report["results"]:
        assert row["batched"]["max_abs_diff"] <= 1e-4, row["op"]
        if row["op"] != "attention":  # stock attention gets the packed row's dense mask: correct too
            assert row["max_abs_diff"] > 100 * max(row["batched"]["max_abs_diff"], 1e-6), row["op"]


def test_equal_lengths_need_a_divisible_row():
    with pytest.raises(ValueError, match="T divisible by n_docs"):
        op_bench.op_modules("mamba2")[0].setup(T=10, n_docs=3, equal_lengths=True)
