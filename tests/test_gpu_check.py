"""The GPU check's plumbing, run on CPU in smoke mode: one JSON with every section, no check erroring."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_check

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_the_script_runs_the_module():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    assert "--smoke" in out


def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--families", "llama", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu"
    assert {o["op"] for o in report["ops"]} == {
        "varlen_attention", "causal_conv1d_varlen", "gated_delta_rule_varlen", "mamba2_chunk_scan_varlen"}
    for op in report["ops"]:
        assert "error" not in op, op
        assert op["ok"] and op["packed_vs_alone_same_kernel"] <= 1e-4, op
    (family,) = report["families"]
    assert family["max_logit_diff_packed_vs_alone"] <= 1e-5
    assert family["compiles_over_6_batches"] == 1
    step = family["compiled_training_step"]
    assert step["sync_error"] is None and step["warm_up_s"] > 0
    assert step["sync_free"] is None  # sync-debug mode exists only on CUDA: on CPU the check is reported as not run
    (speed,) = report["speed"]
    assert speed["patched_compiled"]["tokens_per_s"] > 0 and "stock_sdpa_packed" in speed
