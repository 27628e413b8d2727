"""The GPU check's plumbing, run on CPU in smoke mode: one JSON with every section, no check erroring."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_check
from tools.gpu_check import common, compiles, long_rows
from benchmarks.worker import build_model, stock_path
from compilepack.patching import family_named

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
OPS = {"varlen_attention", "causal_conv1d_varlen", "gated_delta_rule_varlen", "kimi_delta_attention_varlen",
       "mamba2_chunk_scan_varlen"}


def test_the_script_runs_the_module():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    assert "--smoke" in out and "--budget-s" in out


def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--families", "llama", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu"
    assert set(report["environment"]["versions"]) == {"flash_attn", "causal_conv1d", "fla", "mamba_ssm", "torch_varlen"}
    assert {o["op"] for o in report["ops"]} == OPS
    for op in report["ops"]:
        assert "error" not in op, op
        assert op["ok"] and op["packed_vs_alone_same_kernel"] <= 1e-4, op
    # every op on the bug layouts (CPU: the references, so only the plumbing is checked)
    assert {(entry["op"], entry["layout"]) for entry in report["layouts"]} == {
        (op, layout) for op in OPS for layout in common.SMOKE_LAYOUTS}
    for entry in report["layouts"]:
        assert "error" not in entry and entry["ok"] and entry["finite"], entry
    for section in ("known_bugs", "long_rows"):
        assert report[section] == [{"skipped": "CUDA only"}]
    assert report["recompiles"] == {"skipped": "CUDA only"}
    assert report["qlora"] == [{"family": "llama", "skipped": "CUDA only"}]
    (family,) = report["families"]
    assert family["max_logit_diff_packed_vs_alone"] <= 1e-5
    assert family["compiles_over_6_batches"] == 1
    assert family["stock_path"] == "cpu; attention: sdpa"
    step = family["compiled_training_step"]
    assert step["sync_error"] is None and step["warm_up_s"] > 0
    assert step["sync_free"] is None  # sync-debug mode exists only on CUDA: on CPU the check is reported as not run
    (speed,) = report["speed"]
    assert speed["patched_compiled"]["tokens_per_s"] > 0
    assert speed["stock_sdpa_packed"]["stock_path"] == "cpu; attention: sdpa"


def test_sections_past_the_budget_are_skipped_not_dropped(tmp_path):
    out = tmp_path / "check.json"
    gpu_check.main(["--device", "cpu", "--smoke", "--families", "llama", "--budget-s", "0", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {o["op"] for o in report["ops"]} == OPS  # the first section always runs
    for section in ("layouts", "known_bugs", "recompiles"):
        assert report[section]["skipped"].startswith("time budget"), report[section]
    assert report["families"][0]["skipped"].startswith("time budget")
    assert report["speed"][0]["skipped"].startswith("time budget")


def test_stock_path_names_the_fallbacks_a_hybrid_runs():
    path = stock_path(build_model(family_named("qwen3_5"), None, 0), "cpu")
    assert path.startswith("cpu; attention: sdpa; ")
    assert "causal_conv1d_fn: torch fallback" in path and "torch_chunk_gated_delta_rule: torch fallback" in path


def test_varied_batches_fill_their_rows_and_hold_empty_documents():
    for lengths, rows in compiles._varied_batches(1, 6):
        assert sum(lengths) % rows == 0 and 0 in lengths
        assert all(n >= 0 for n in lengths)


def test_largest_admitted_bisects_to_the_bound():
    assert long_rows._largest_admitted(lambda tokens: tokens * 8192 < 2**31, 128, 2**31 // 8192 + 512) == 262144 - 128
