#!/usr/bin/env bash
# The family tests on the newest torch the package index serves, in a scratch virtual environment: torch is not
# pinned here (pyproject admits torch>=2.11), so the release users get from a fresh `pip install` is tested the day
# it appears. CI runs it after the main suite (which pins the tested 2.13.0 CPU wheel). TORCH="torch==2.11.0" tests
# the floor instead (CI's oldest-torch stage): the editable install must keep that torch.
#
#   tests/check_newest_torch.sh                                  # venv .torch-venv, tests/patches/test_families.py
#   tests/check_newest_torch.sh .ci-torch-venv tests/patches/test_families.py -n 2   # CI: two workers
#   STEP=install tests/check_newest_torch.sh .ci-torch-venv; STEP=test tests/check_newest_torch.sh .ci-torch-venv ...
#                                  # CI: the install (a download) runs while other stages test, the tests after them
set -euo pipefail
step="${STEP:-both}"
venv="${1:-.torch-venv}"
shift $(( $# >= 1 ? 1 : 0 ))
cd "$(dirname "$0")/.."

if [[ "$step" != test ]]; then
    python3 -m venv "$venv"
    . "$venv/bin/activate"
    python -m pip install --quiet --upgrade pip
    # A machine may cap torch with a pip constraints file (to keep a local wheel): lifted for these installs. On a
    # CPU machine this is the CUDA build from the index (~3 GB with its CUDA libraries); it runs the CPU code paths.
    PIP_CONSTRAINT=/dev/null python -m pip install --quiet --upgrade "${TORCH:-torch}"
    PIP_CONSTRAINT=/dev/null python -m pip install --quiet -e . "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.3" \
        "pytest-xdist>=3.5"
    if [[ -n "${TORCH:-}" ]]; then  # the project's own install must not have moved the torch asked for
        python -c "import sys, torch; from packaging.requirements import Requirement as R; \
sys.exit(0 if R('$TORCH').specifier.contains(torch.__version__.split('+')[0]) else \
f'pip install -e . replaced $TORCH with torch {torch.__version__}')"
    fi
fi
[[ "$step" == install ]] && exit 0
. "$venv/bin/activate"
python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
python -m pytest -q -p no:cacheprovider "${@:-tests/patches/test_families.py}"
