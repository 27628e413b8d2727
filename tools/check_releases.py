"""Try upstream releases against the suite, each in a scratch virtual environment, and print a table.

Developers run it before admitting a release (issue 40; usage in docs/integrations.md, "Upstream releases"); CI
runs it on the oldest admitted releases (``--oldest-admitted``). The admitted ranges are read from pyproject.toml,
nowhere else; releases are what ``pip index versions`` lists. Each run prints one table row (release, admitted?,
passed / failed, first failure): the family tests for transformers and torch, the trainer tests for trl, accelerate
and peft. Exit status 1 if an admitted release fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("transformers", "trl", "accelerate", "peft", "torch")
FAMILY_TESTS = ["tests/patches/test_families.py"]
TRAINER_TESTS = ["tests/integrations/test_trl.py", "tests/integrations/test_trl_releases.py",
                 "tests/integrations/test_trainer.py", "tests/integrations/test_peft.py"]
TESTS = {"transformers": FAMILY_TESTS, "torch": FAMILY_TESTS,
         "trl": TRAINER_TESTS, "accelerate": TRAINER_TESTS, "peft": TRAINER_TESTS}
# The CPU wheel on disk; any other torch is the CUDA build from the index (~3 GB), which runs the CPU paths here.
TESTED_TORCH = "2.13.0"


def requirements() -> dict[str, Requirement]:
    """Each package's admitted range, and every other requirement a test venv needs, as pyproject states them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + project["optional-dependencies"]["test"]
    return {Requirement(line).name: Requirement(line) for line in listed}


def published(package: str) -> list[Version]:
    """Final releases on the index, oldest first (``pip index versions``)."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package],
                          capture_output=True, text=True, check=True)
    listed = re.search(r"Available versions: (.*)", done.stdout).group(1)
    versions = {Version(v.strip().split("+")[0]) for v in listed.split(",")}
    return sorted(v for v in versions if not v.is_prerelease and not v.is_devrelease)


def admitted_bounds(package: str, wanted: dict[str, Requirement]) -> tuple[Version, Version]:
    """The oldest and the newest published release that pyproject admits."""
    inside = [v for v in published(package) if wanted[package].specifier.contains(v)]
    if not inside:
        raise SystemExit(f"no published {package} release satisfies pyproject's {wanted[package]}")
    return inside[0], inside[-1]


def run_in_venv(pins: dict[str, str], tests: list[str], venv: Path, pytest_args: list[str],
                step: str = "both") -> tuple[str, str]:
    """A fresh venv with ``pins`` (package -> version), every other requirement as pyproject states it and the
    project (``--no-deps``: a release pyproject does not admit can be tried); then the tests. Returns (passed /
    failed counts, first failure). ``step``: ``"install"`` only builds the venv, ``"test"`` tests in a built one."""
    env = {**os.environ, "PIP_NO_CACHE_DIR": "1"}
    if step != "test":
        installed = _install(pins, venv, env)
        if installed is not None or step == "install":
            return installed or ("installed", "")
    python = str(venv / "bin" / "python")
    # --show-capture=no: a failure's captured logs (dynamo's DEBUG lines) would bury its assertion
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "--tb=short",
                           "--show-capture=no", *tests, *pytest_args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    print(done.stdout[-6000:], file=sys.stderr)
    return summarize(done.stdout)


def _install(pins: dict[str, str], venv: Path, env: dict) -> tuple[str, str] | None:
    """Build ``venv`` with the pins; None when it is ready, else the row saying why not."""
    wanted = requirements()
    specs = [f"{name}=={version}" for name, version in pins.items()]
    specs += [str(req) for name, req in wanted.items() if name not in pins]
    if "torch" not in pins:
        specs = [s for s in specs if Requirement(s).name != "torch"] + [f"torch=={TESTED_TORCH}"]
    if pins.get("torch", TESTED_TORCH) != TESTED_TORCH:
        env["PIP_CONSTRAINT"] = "/dev/null"  # a machine may cap torch to its local wheel: lifted for this venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet"]
    install = subprocess.run(pip + specs, env=env, capture_output=True, text=True)
    if install.returncode != 0:
        return "not installed", ([line for line in install.stderr.splitlines() if line.strip()] or [""])[-1][:160]
    subprocess.run(pip + ["--no-deps", "-e", str(ROOT)], env=env, check=True)
    return None


def summarize(output: str) -> tuple[str, str]:
    """pytest's summary line as "N passed / M failed", and its first ``FAILED`` line (or "")."""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|error)", output.splitlines()[-1])} \
        if output.strip() else {}
    failures = [line[len("FAILED "):] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    result = f"{counts.get('passed', 0)} passed / {counts.get('failed', 0) + counts.get('error', 0)} failed"
    return result, (failures[0][:160] if failures else "")


def table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ["release", "admitted?", "passed / failed", "first failure"]
    lines = [f"Measured {datetime.date.today().isoformat()} (python tools/check_releases.py):", "",
             "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", help="package or package==version (default: each package's newest)")
    parser.add_argument("--oldest-admitted", action="store_true",
                        help="the oldest admitted release of every package together, one venv, family + trainer tests")
    parser.add_argument("--list", action="store_true", help="print the releases only; run nothing")
    parser.add_argument("--venv", default=".releases-venv", help="scratch venv path (removed after each run)")
    parser.add_argument("--keep", action="store_true", help="keep the venv")
    parser.add_argument("--pytest-args", default="", help='extra pytest arguments, e.g. "-n 2 -x"')
    parser.add_argument("--step", choices=("both", "install", "test"), default="both",
                        help="install the venv only (kept), or test in a venv an earlier --step install built")
    args = parser.parse_args(argv)
    wanted = requirements()

    if args.list:
        for package in PACKAGES:
            oldest, newest = admitted_bounds(package, wanted)
            print(f"{package}: newest published {published(package)[-1]}; admitted {wanted[package].specifier} "
                  f"-> oldest {oldest}, newest {newest}")
        return 0

    if args.oldest_admitted:
        pins = {p: str(admitted_bounds(p, wanted)[0]) for p in PACKAGES if p != "torch"}
        runs = [(pins, FAMILY_TESTS + TRAINER_TESTS)]
    else:
        runs = []
        for item in args.releases or PACKAGES:
            package, _, version = item.partition("==")
            runs.append(({package: version or str(published(package)[-1])}, TESTS[package]))

    rows, failed_admitted = [], False
    for pins, tests in runs:
        venv = ROOT / args.venv
        result, first = run_in_venv(pins, tests, venv, shlex.split(args.pytest_args), args.step)
        if args.step == "install":
            print(f"{', '.join(f'{p} {v}' for p, v in pins.items())}: {result} {first}".strip(), file=sys.stderr)
            if result != "installed":
                return 1
            continue
        admitted = all(wanted[p].specifier.contains(v) for p, v in pins.items())
        release = ", ".join(f"{p} {v}" for p, v in pins.items())
        rows.append((release, "yes" if admitted else "no", result, first))
        passed = result.endswith("/ 0 failed") and not result.startswith("0 passed") and first == ""
        failed_admitted |= admitted and not passed  # a run that ran nothing (not installed, crashed) is no pass
        if not args.keep:
            shutil.rmtree(venv, ignore_errors=True)
        print(table(rows[-1:]), file=sys.stderr, flush=True)
    if args.step == "install":
        return 0
    print(table(rows))
    return 1 if failed_admitted else 0


if __name__ == "__main__":
    sys.exit(main())
