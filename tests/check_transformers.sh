#!/usr/bin/env bash
# The family tests against one transformers release, in a scratch virtual environment: the measured step before a
# release is admitted in pyproject.toml (and, for a new minor, before the upper bound moves). CI runs it for the
# oldest admitted release.
#
#   tests/check_transformers.sh 5.25.0                       # venv .tf-venv-5.25.0, every test in tests/patches
#   tests/check_transformers.sh 5.18.0 .ci-tf-venv tests/patches/test_families.py -n 2   # CI: two workers
set -euo pipefail
version="${1:?usage: tests/check_transformers.sh <transformers version> [venv dir] [pytest args...]}"
venv="${2:-.tf-venv-$version}"
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.."

python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0" "transformers==$version" "packaging>=23" "pytest>=8" "hypothesis>=6.100" \
    "pytest-timeout>=2.3" "pytest-xdist>=3.5"
python -m pip install --quiet --no-deps -e .  # compilepack itself, whatever range its pyproject admits today
python -c "import transformers; print('transformers', transformers.__version__)"
python -m pytest -q -p no:cacheprovider "${@:-tests/patches}"
