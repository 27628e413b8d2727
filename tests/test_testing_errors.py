"""compilepack.testing's contract on a model that raises: every ``check_*`` returns a failed CheckResult carrying the
model's error (type and message), every ``assert_*`` raises ``AssertionError`` chained to it, and ``python -m
compilepack check`` names such a check by its full name in the table and the JSON."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

import compilepack.cli.check
from compilepack import testing
from compilepack.cli.check import format_table, run_checks
from compilepack.cli import main
from compilepack.patching import family_named
from tests.families import build_tiny, tiny_config

MESSAGE = "stand-in: this model cannot run packed batches"


class RaisingModel(torch.nn.Module):
    """A stand-in for a model that cannot run a packed batch: every forward raises ValueError."""

    def __init__(self):
        super().__init__()
        self.config = tiny_config(family_named("llama"))
        self.embed = torch.nn.Embedding(self.config.vocab_size, 8)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, **batch):
        raise ValueError(MESSAGE)


BATCHES = testing.packed_batches(256)[:1]
PAIRS = {  # full name: (check, assert, arguments after the model)
    "packed == alone": (testing.check_packed_matches_unpacked, testing.assert_packed_matches_unpacked, (BATCHES,)),
    "isolation": (testing.check_documents_isolated, testing.assert_documents_isolated, (BATCHES,)),
    "compile": (testing.check_compiles_once, testing.assert_compiles_once, (testing.varied_batches(256, count=2),)),
    "bf16 autocast": (testing.check_bf16_close, testing.assert_bf16_close, (BATCHES[0],)),
    "refusal": (testing.check_refuses_bad_batches, testing.assert_refuses_bad_batches, ()),
}


@pytest.mark.parametrize("name", PAIRS)
def test_every_check_returns_and_every_assert_raises_assertion_error_on_a_raising_model(name):
    check, assert_, arguments = PAIRS[name]
    result = check(RaisingModel(), *arguments)
    assert isinstance(result, testing.CheckResult) and result.name == name and not result.passed
    assert f"ValueError: {MESSAGE}" in str(result) and isinstance(result.error, ValueError), str(result)
    with pytest.raises(AssertionError, match=rf"{re.escape(name)} FAILED: (?s:.*)ValueError: {MESSAGE}") as failure:
        assert_(RaisingModel(), *arguments)
    assert isinstance(failure.value.__cause__, ValueError) and str(failure.value.__cause__) == MESSAGE


@pytest.mark.skipif(importlib.util.find_spec("causal_conv1d") is not None,
                    reason="with causal_conv1d installed the stock hybrid runs boundary kwargs")
def test_stock_hybrid_with_boundary_kwargs_fails_the_packed_check_instead_of_raising():
    torch.manual_seed(0)
    stock = build_tiny(family_named("qwen3_5")).eval()
    result = testing.check_packed_matches_unpacked(stock, BATCHES, gradients=False, control=False)
    assert not result.passed and result.figure == "error: ValueError", str(result)
    assert "raised ValueError: `causal_conv1d_fn` can't keep packed sequences apart" in result.details[0]
    with pytest.raises(AssertionError, match="packed == alone FAILED: error: ValueError") as failure:
        testing.assert_packed_matches_unpacked(stock, BATCHES, gradients=False, control=False)
    assert isinstance(failure.value.__cause__, ValueError)


def test_a_check_that_errors_keeps_its_full_name_in_the_table_and_the_json(tmp_path, monkeypatch, capsys):
    results = run_checks(RaisingModel(), ["packed", "bf16"])
    assert [r.name for r in results] == ["packed == alone", "bf16 autocast"]
    assert "packed == alone  FAIL    error: ValueError" in format_table(results)
    monkeypatch.setattr(compilepack.cli.check, "load_model", lambda args: (RaisingModel(), "a raising stand-in"))
    report = tmp_path / "report.json"
    assert main(["check", "llama", "--stock", "--checks", "packed,bf16", "--json", str(report)]) == 1
    assert "bf16 autocast    FAIL    error: ValueError" in capsys.readouterr().out
    checks = json.loads(report.read_text())["checks"]
    assert [(c["name"], c["figure"]) for c in checks] == [("packed == alone", "error: ValueError"),
                                                          ("bf16 autocast", "error: ValueError")]
    assert checks[0]["details"] == [f"raised ValueError: {MESSAGE}"]
