"""The GPU check (``python -m tools.gpu_check``) end to end on CPU, simulated: every section runs with the references
for the kernels, the JSON is written and read back, so an import error or a broken section is caught before a GPU is
lent. Plus the refusals, the time guards, the hidden libraries and the caches' archives."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from compilepack.ops import backends
from tools.gpu_check import common, ops, run

ROOT = Path(__file__).resolve().parents[2]
OPS = {"varlen_attention", "causal_conv1d_varlen", "gated_delta_rule_varlen", "kimi_delta_attention_varlen",
       "mamba2_chunk_scan_varlen"}


def _errors(node, path="report"):
    """Every recorded error in the report, with where it is."""
    if isinstance(node, dict):
        found = [f"{path}: {node['error']}"] if "error" in node else []
        return found + [e for key, value in node.items() for e in _errors(value, f"{path}.{key}")]
    if isinstance(node, list):
        return [e for i, value in enumerate(node) for e in _errors(value, f"{path}[{i}]")]
    return []


def test_the_simulated_check_runs_every_section(tmp_path):  # ~45 s of CPU
    out = tmp_path / "check.json"
    assert run.main(["--simulate", "--families", "llama", "--out", str(out), "--cache-dir", str(tmp_path)]) == 0
    report = json.loads(out.read_text())
    assert _errors(report) == []
    assert list(report["sections"]) == list(run.SECTIONS)
    assert all(entry["wall_s"] >= 0 and "skipped" not in entry for entry in report["sections"].values())
    assert report["environment"]["simulated"] and report["caches"]["TRITON_CACHE_AUTOTUNING"] == "1"
    assert {o["op"] for o in report["ops"]} == OPS
    for op in report["ops"]:
        assert op["ok"] and op["packed_vs_alone_same_kernel"] <= 1e-4 and op["wall_s"] >= 0, op
    assert {(e["op"], e["layout"]) for e in report["layouts"]} == {
        (op, layout) for op in OPS for layout in list(common.SIMULATED_LAYOUTS)[:2]}
    assert all(e["ok"] and e["finite"] for e in report["layouts"])
    (speed,), (family,) = report["speed"], report["families"]
    assert speed["patched_compiled"]["tokens_per_s"] > 0 and speed["stock_sdpa_packed"]["tokens_per_s"] > 0
    assert family["max_logit_diff_packed_vs_alone"] <= 1e-5 and family["compiles_over_batches"]["compiles"] == 1
    assert family["stock_path"] == "cpu; attention: sdpa" and family["explain_forward"].startswith("1 graph(s), 0")
    step = family["compiled_training_step"]
    assert step["sync_free"] is None  # sync-debug mode exists on CUDA only: on CPU it is reported as not run
    assert step["host_boundaries"]["sync_error"] is None and step["device_boundaries"]["sync_error"] is None
    probes = report["hopper_probes"]
    for name in ("gdn_head_dim_64", "gdn_head_dim_128", "kda_padding_document", "gathered_keys_equal_heads"):
        assert probes[name]["ok"] and probes[name]["relative_error"] <= 1e-4, (name, probes[name])
    assert report["known_bugs"][0]["ok"] and report["known_bugs"][0]["library_alone"] == "ran"
    assert {e["op"] for e in report["sequence_ops"]} == {
        "gated_delta_rule_varlen_state", "kimi_delta_attention_varlen_state", "mamba2_chunk_scan_varlen_state",
        "varlen_attention_kv"}
    assert all(e["ok"] for e in report["sequence_ops"])
    assert all(entry["ok"] for entry in report["recompiles"].values())
    (lora,) = report["qlora"]
    assert lora["compiled_vs_eager"]["max_lora_grad_diff"] <= 1e-5 and lora["compiled_vs_eager"]["compiles"] == 1
    assert not out.with_suffix(".partial").exists()


def test_a_spent_budget_skips_every_section_with_its_reason(tmp_path):
    out = tmp_path / "check.json"
    run.main(["--simulate", "--families", "llama", "--budget-s", "0", "--out", str(out), "--cache-dir", str(tmp_path)])
    report = json.loads(out.read_text())
    assert report["families"][0]["skipped"].startswith("time budget") and report["speed"] == report["families"]
    for name in run.SECTIONS[1:]:
        assert report[name]["skipped"].startswith("time budget"), name
        assert report["sections"][name]["skipped"] == report[name]["skipped"]


def test_the_op_check_misses_by_far_when_boundaries_are_dropped():
    """The control of the exactness checks: one document where there are three is caught."""
    make = common.op_cases("cpu")["varlen_attention"]

    def one_document(lengths, rows, dtype, layout=None):
        tensors, dims, call = make(lengths, rows, dtype, layout)
        return tensors, dims, lambda x, ls, r, b: call(x, [sum(ls)], r, b)

    honest = ops.check_op("varlen_attention", make, backends.REFERENCE, common.torch.float32, [5, 1, 70])
    broken = ops.check_op("varlen_attention", one_document, backends.REFERENCE, common.torch.float32, [5, 1, 70])
    assert honest["packed_vs_alone_same_kernel"] <= 1e-5
    assert broken["packed_vs_alone_same_kernel"] > 1e-2


def _refusing_fla(monkeypatch):
    """fla 0.5.2 installed, as compilepack sees it: below its floor, refused for both delta rules."""
    real_installed, real_version = backends.is_installed, backends.installed_version
    monkeypatch.setattr(backends, "is_installed", lambda name: name == "fla" or real_installed(name))
    monkeypatch.setattr(backends, "installed_version", lambda name: "0.5.2" if name == "fla" else real_version(name))


def test_a_refused_backend_is_recorded_and_never_run(monkeypatch):
    _refusing_fla(monkeypatch)
    gdn, kda = "gated_delta_rule_varlen", "kimi_delta_attention_varlen"
    admitted, refused = common.admitted_backends()
    assert admitted[gdn] == admitted[kda] == []
    assert list(refused) == [f"{gdn}:fla", f"{kda}:fla"] and "fla-core 0.5.2 is installed" in refused[f"{gdn}:fla"]
    ctx = common.Context(common.torch.device("cpu"), common.torch.float32, True, common.Budget(60), "eager",
                         ["llama"], admitted, refused)
    assert ctx.chosen()[gdn] == "reference" and ctx.paths(gdn) == ["reference"]
    paths, passed_over = ops.kernel_paths(ctx)
    assert (gdn, "reference") in paths and all(b != "fla" for _, b in paths)
    assert list(passed_over) == [f"{gdn}:fla", f"{kda}:fla"]
    assert "refused" in common.auto_outcome() or common.auto_outcome().get("warnings")  # today's or the skip's


def test_a_library_refused_for_an_op_is_hidden_from_stock_imports_only(monkeypatch):
    seen = []
    real = common.transformers.AutoModelForCausalLM.from_config

    def from_config(config):  # what `import fla` gives while the family's transformers module is imported
        try:
            importlib.import_module("fla")
        except ImportError as error:
            seen.append(str(error))
        return real(config)

    monkeypatch.setattr(common.transformers.AutoModelForCausalLM, "from_config", from_config)
    monkeypatch.setitem(sys.modules, "fla", "the module")  # as if imported: put back after
    # refused for the gated delta rule only (fla #640), admitted for KDA: stock Qwen3.5 would still bind it
    hidden = common.hide_from_stock({"gated_delta_rule_varlen:fla": "refused", "varlen_attention:torch_varlen":
                                     "refused"}, ["llama"])
    assert list(hidden) == ["fla"] and len(seen) == 1  # torch itself is never hidden
    assert sys.modules["fla"] == "the module"
    assert common.hide_from_stock({}, []) == {}


def test_the_caches_pack_into_parts_and_unpack(tmp_path):
    source, out, back = tmp_path / "cache", tmp_path / "out", tmp_path / "back"
    (source / "triton" / "abc").mkdir(parents=True)
    (source / "triton" / "abc" / "k.autotune.json").write_text('{"configs": 2}')
    out.mkdir()
    sizes = run.pack_caches(source, out, limit_mb=36)
    assert list(sizes) == ["triton"] and sorted(p.name for p in out.iterdir()) == ["gpucache-triton.tar.xz.aa"]
    assert run.unpack_caches(out, back) == {"triton": 1}
    assert (back / "triton" / "abc" / "k.autotune.json").read_text() == '{"configs": 2}'


def test_varied_batches_fill_their_rows_and_hold_empty_documents():
    for lengths, rows in ops.varied_batches(1, 6):
        assert sum(lengths) % rows == 0 and 0 in lengths and all(n >= 0 for n in lengths)


def test_the_check_never_imports_the_benchmark():
    """tools/ imports compilepack only (issue 50)."""
    for path in (ROOT / "tools" / "gpu_check").glob("*.py"):
        assert "benchmarks" not in {line.split()[1].split(".")[0] for line in path.read_text().splitlines()
                                    if line.startswith(("import ", "from "))}, path


@pytest.mark.multiprocess
def test_the_entry_and_the_probes_child_run_as_modules(tmp_path):
    command = [sys.executable, "-m", "tools.gpu_check"]
    assert "--simulate" in subprocess.run(command + ["--help"], cwd=ROOT, capture_output=True, text=True,
                                          check=True).stdout
    out = tmp_path / "probe.json"
    subprocess.run(command + ["--probe", "hopper", "--simulate", "--device", "cpu", "--out", str(out)], cwd=ROOT,
                   check=True, capture_output=True)
    probes = json.loads(out.read_text())
    assert probes["gdn_head_dim_128"]["ok"] and probes["kda_padding_document"]["ok"], probes
