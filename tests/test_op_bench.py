"""The op benchmark (``python -m benchmarks ops``) runs end to end on tiny sizes, and its second comparison
is a correctness cross-check: packed on equal-length documents equals the stock function on their batch."""

import json

import pytest

from benchmarks import ops as op_bench

OPS = "attention,causal_conv1d,gated_delta_rule,mamba2,kimi_delta_attention"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("ops")
    args = ["--ops", OPS, "--T", "96", "--n-docs", "4", "--repeats", "1", "--warmup", "0", "--threads", "1",
            "--out", str(out)]
    assert op_bench.main(args) == 0
    (path,) = out.glob("ops-cpu-*.json")
    return json.loads(path.read_text())


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
