"""Repository-level promises: the README's commands, the registry's completeness, lazy CUDA imports, the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import compilepack

ROOT = Path(__file__).resolve().parents[1]
CUDA_ONLY_MODULES = ("flash_attn", "fla", "mamba_ssm", "causal_conv1d", "triton")


def test_ci_runs_exactly_the_readme_test_command():
    readme_commands = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    test_command = readme_commands[1].split("&&")[-1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines  # in the fresh venv; the kernel stage follows it
    assert "python -m compilepack bench" in readme_commands[0]


def test_every_family_has_test_configs_a_bench_model_and_a_docs_row():
    """A family is a file in patches/ plus an entry in each of these tables (where they are used)."""
    from compilepack.bench.configs import BENCH_CONFIGS
    from compilepack.bench.models_doc import KERNELS, STOCK_PACKED
    from tests.families import TINY_CONFIGS

    table = (ROOT / "docs" / "models.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")}
    names = {family.name for family in compilepack.families()}
    for where, entries in (("tests/families.py TINY_CONFIGS", TINY_CONFIGS),
                           ("compilepack/bench/configs.py BENCH_CONFIGS", BENCH_CONFIGS),
                           ("compilepack/bench/models_doc.py KERNELS", KERNELS),
                           ("compilepack/bench/models_doc.py STOCK_PACKED", STOCK_PACKED)):
        assert set(entries) == names, f"{where}: missing {names - set(entries)}, unknown {set(entries) - names}"
    assert names <= rows, f"docs/models.md has no row for {names - rows}"


def test_every_patch_module_registers_a_family():
    modules = {p.stem for p in (ROOT / "patches").glob("*.py") if not p.stem.startswith("_")}
    registered = {f.modeling.rsplit(".", 1)[-1].removeprefix("modeling_") for f in compilepack.families()}
    registering_files = set()
    for module in modules:
        text = (ROOT / "patches" / f"{module}.py").read_text()
        if "register(" in text:
            registering_files.add(module)
    assert registering_files == modules
    assert registered  # at least the headline families


def test_every_package_is_installed():
    """pyproject lists packages explicitly (patches/ is mapped to compilepack.patches): a new subpackage, such as
    an op's folder, must be listed or a wheel install would lack it."""
    listed = set(re.findall(r'"(compilepack[\w.]*)"', (ROOT / "pyproject.toml").read_text().split("packages = [")[1]))
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "compilepack").rglob("__init__.py")
    } | {"compilepack.patches"}
    assert found <= listed, f"add to pyproject's packages: {sorted(found - listed)}"


def test_importing_and_patching_imports_no_cuda_library():
    code = (
        "import sys, compilepack, torch\n"
        "from compilepack.bench.configs import build_bench_model\n"
        "for name in ('llama', 'qwen3_next', 'bamba'):\n"
        "    compilepack.patch(build_bench_model(name))\n"
        f"print([m for m in sys.modules if m.split('.')[0] in {CUDA_ONLY_MODULES!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_explain_cli_prints_stock_next_to_patched():
    out = subprocess.run(
        [sys.executable, "-m", "compilepack", "explain", "llama", "--batches", "3"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    lines = out.splitlines()
    stock = next(line for line in lines if line.startswith("stock"))
    patched = next(line for line in lines if line.startswith("patched"))
    assert patched.count("1 graph, 0 brk") == 2
    assert float(patched.split()[-1]) <= 1e-5 and float(stock.split()[-1]) > 1e-2
