"""Repository-level promises: the README's commands, the registry's completeness, lazy CUDA imports, the CLI."""

from __future__ import annotations

import ast
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
    assert readme_commands[0].splitlines()[0].split("&&")[-1].strip() == "python -m benchmarks"


def test_every_family_declares_its_test_models_bench_model_and_docs_row():
    """A family is one file in patches/: its declaration holds its tiny test models, its bench config and its
    docs row (and, where benchmarked at real widths, its checkpoint); docs/models.md has its row."""
    table = (ROOT / "docs" / "models.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")}
    for family in compilepack.families():
        fixtures = family.fixtures
        assert fixtures.tiny and fixtures.bench is not None and fixtures.docs is not None, family.name
        assert fixtures.docs.stock_packed and family.kernels, family.name
        assert family.name in rows, f"docs/models.md has no row for {family.name}"
    headline = {"llama", "qwen3_next", "qwen3_5", "bamba"}
    assert headline <= {family.name for family in compilepack.families() if family.fixtures.checkpoint is not None}


def test_a_family_is_named_in_one_file_of_the_package():
    """Adding a family is one file: its name, as a string, appears in its own patches/ file and nowhere else in
    the package (compilepack/ and patches/). A table keyed by family names elsewhere would fail this."""
    files = [*ROOT.glob("compilepack/**/*.py"), *ROOT.glob("patches/*.py")]
    texts = {path: path.read_text() for path in files}
    for family in compilepack.families():
        quoted = re.compile(rf"[\"']{re.escape(family.name)}[\"']")
        places = sorted(str(path.relative_to(ROOT)) for path, text in texts.items() if quoted.search(text))
        assert places == [f"patches/{family.name}.py"], f"{family.name} is named in {places}"


def test_the_library_never_imports_the_benchmark():
    """benchmarks/ is run from a checkout and imports compilepack; compilepack imports nothing of it (the wheel
    does not ship it)."""
    imports = re.compile(r"^\s*(from|import)\s+benchmarks\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in [*ROOT.glob("compilepack/**/*.py"), *ROOT.glob("patches/*.py")]
                 if imports.search(p.read_text())]
    assert offenders == []


# The library's layers, from the ground up: a module imports only from its own layer or those below it (the
# package's face, compilepack/__init__.py, sits above the library; the command line above the face).
LAYERS = ("errors", "batch", "distributed", "ops", "patching", "patches", "integrations", "testing",
          "__init__", "cli", "__main__")
# the registry imports the family files it discovers (a plugin folder, loaded on first use), the one import upward
DISCOVERS = {("compilepack/patching/registry.py", "compilepack.patches")}


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_submodule(package: str, name: str) -> bool:
    """Whether ``from package import name`` imports a module (``from .. import patching``), not a name in it."""
    where = ROOT.joinpath(*package.split("."), name)
    return where.is_dir() or where.with_suffix(".py").is_file()


def _library_imports(path: Path) -> set[str]:
    """The compilepack modules one file imports (function-level imports included), as dotted names."""
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    if name.startswith("patches"):
        name = "compilepack." + name
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "compilepack"}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            if target.split(".")[0] == "compilepack":
                found |= {f"{target}.{a.name}" if _is_submodule(target, a.name) else target for a in node.names}
    return found


def test_imports_point_down_the_layers():
    """No module imports a layer above its own (LAYERS), so no two layers import each other: the layout shows the
    architecture. A new top-level module or subpackage must be placed in LAYERS."""
    files = [*ROOT.glob("compilepack/**/*.py"), *ROOT.glob("patches/*.py")]
    upward = []
    for path in files:
        here = "patches" if path.parts[-2] == "patches" else _layer_of(
            ".".join(path.relative_to(ROOT).with_suffix("").parts))
        assert here in LAYERS, f"{path.relative_to(ROOT)}: place its layer '{here}' in LAYERS"
        for module in _library_imports(path):
            there = _layer_of(module)
            if LAYERS.index(there) > LAYERS.index(here) and (str(path.relative_to(ROOT)), module) not in DISCOVERS:
                upward.append(f"{path.relative_to(ROOT)} imports {module} ({there} is above {here})")
    assert upward == []


def test_the_package_top_level_holds_only_its_face():
    """What the package holds loose at its top level: the face, ``python -m``, the errors (every layer raises them)
    and the modules not yet in a subpackage. Everything else lives in a subpackage named for its layer."""
    loose = sorted(p.name for p in (ROOT / "compilepack").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py"]


def _readme_code_map() -> list[str]:
    """The paths of the README's "Map of the code", in order."""
    section = (ROOT / "README.md").read_text().split("## Map of the code\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `([^`]+)`:", section, re.M)


def _design_code_map() -> list[str]:
    """The paths of docs/design.md's map (the first code block under "The layers of the code"), in order."""
    section = (ROOT / "docs" / "design.md").read_text().split("## The layers of the code\n", 1)[1]
    block = section.split("```\n", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line and not line[0].isspace()]


def test_the_design_code_map_matches_the_readme_map():
    """docs/design.md's map (by layer, with detail) and the README's name the same paths, each of which exists."""
    readme, design = _readme_code_map(), _design_code_map()
    assert len(readme) >= 10 and len(set(readme)) == len(readme), readme
    assert sorted(design) == sorted(readme), (set(design) ^ set(readme))
    assert [path for path in readme if not (ROOT / path).exists()] == []


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
        "from transformers import AutoModelForCausalLM\n"
        "for name in ('llama', 'qwen3_next', 'bamba'):\n"
        "    config = compilepack.patching.family_named(name).bench_config()\n"
        "    compilepack.patch(AutoModelForCausalLM.from_config(config))\n"
        f"print([m for m in sys.modules if m.split('.')[0] in {CUDA_ONLY_MODULES!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_patch_option_works_after_importing_compilepack_alone():
    """A fresh interpreter, as a user's script starts: patch()'s extension options (lm_head) are read by modules that
    register themselves on import; one left unimported made ``patch(model, lm_head="chunked")`` fail unless some
    other import had pulled it in (a test run in one order passed, in another failed)."""
    code = (
        "import compilepack\n"
        "from transformers import AutoModelForCausalLM\n"
        "config = compilepack.patching.family_named('llama').bench_config()\n"
        "model = compilepack.patch(AutoModelForCausalLM.from_config(config), lm_head='chunked')\n"
        "from compilepack.patching.chunked_head import has_chunked_head  # only now: an import that registers\n"
        "print(has_chunked_head(model))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


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
