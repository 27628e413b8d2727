#!/usr/bin/env bash
# The kernel stage's environment: compilepack with its test extra plus the real Triton kernel libraries, run on
# CPU tensors under Triton's interpreter (tests/kernels/conftest.py). Usage: tests/kernels/install.sh <venv dir>
set -euo pipefail
venv="${1:?usage: tests/kernels/install.sh <venv dir>}"
cd "$(dirname "$0")/../.."

python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
# the CPU wheel of torch that lies on disk; the kernel libraries' own dependency lists would pull CUDA builds
python -m pip install --quiet "torch==2.13.0" "triton==3.9.0" einops -e ".[test]"
# fla: pure Python + Triton; the oldest release compilepack admits (pyproject: fla >= 0.6)
python -m pip install --quiet --no-deps "fla-core==0.6.0" "flash-linear-attention==0.6.0"
# mamba-ssm without its CUDA extensions (this machine cannot build them): only its Triton kernels are used, which
# compilepack reaches without the package __init__ (compilepack.ops.backends.load). Without FORCE_BUILD its setup
# tries to download a prebuilt CUDA wheel.
MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE \
    python -m pip install --quiet --no-deps --no-build-isolation "mamba-ssm==2.3.2.post1"
