#!/usr/bin/env bash
# Wheels the GPU check needs on the lent H200 machine, which has torch and triton but no internet. transformers 5.25
# needs huggingface-hub 2.x (and its httpx2, httpcore2, hf-xet, click): the image's hub 1.33 fails its import check
# (seen on the lent H200, 2026-12-04), so they travel too.
# Run here (a machine with PyPI); the device command installs them with --no-index --no-deps.
#
#   bash benchmarks/gpu_wheels.sh                        # fills .whl/ (ignored by git, carried by the device tool)
#   # on the device (the device tool's run, carry [".whl", ".gpucache"]; the full command: docs/benchmarks.md):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD timeout 500 python3 -m tools.gpu_check --out $OUT/gpu_check.json --cache-out $OUT
#
# Never carried: flash-attn (no prebuilt wheel on PyPI, and its CUDA build does not fit a device command), so on the
# device attention uses torch's varlen_attn where compilepack admits it, else the reference. causal-conv1d publishes
# no wheel either: the conv op runs its pure-torch reference, and the check records "not installed".
# WITH_SDISTS=1 also fetches causal-conv1d 1.6.2.post1's sdist (the last release with the seq_idx tail read,
# causal-conv1d #117); on a device with nvcc it builds for Hopper alone in a few minutes of device time, before the
# check (a lease of its own: the check needs the rest of one):
#   CAUSAL_CONV1D_FORCE_BUILD=TRUE TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install -q --no-index \
#     --no-deps --no-build-isolation --target /tmp/site .whl/causal_conv1d-1.6.2.post1.tar.gz
# fla is pure Python + Triton and is carried (0.6.0, compilepack's floor): where compilepack refuses it (Hopper with
# Triton < 3.7.1, fla #640) the check hides it from stock and patched alike and runs it only in its Hopper probes'
# child process. mamba-ssm is built here without its CUDA extensions (a pure-Python wheel): its Triton SSD kernels
# are what the Mamba2 op uses, reached past its package __init__ (compilepack.ops.backends.load), so the Mamba2 scan
# runs mamba-ssm's kernels on the device. The versions are read from these packages' metadata
# (compilepack.ops.backends.FLOORS): --target keeps it beside them. .whl/ is in .gitignore.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl \
  "transformers==5.25.0" "huggingface-hub>=2.4,<3" "httpx2>=2,<3" "httpcore2" "hf-xet>=1.6,<2" "click>=8.4.2" \
  "truststore>=0.10" "anyio>=4.10" "idna>=3.18" "h11>=0.16" \
  "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" "regex>=2025.10.22" \
  "flash-linear-attention==0.6.0" "fla-core==0.6.0" "einops" "typer" "shellingham" "rich" "markdown-it-py" "mdurl"
MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE \
  python3 -m pip wheel --quiet --no-deps --no-build-isolation "mamba-ssm==2.3.2.post1" -w .whl
if [ "${WITH_SDISTS:-0}" = 1 ]; then
  # the sdist only (its metadata step needs no CUDA with these two set)
  CAUSAL_CONV1D_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE python3 -m pip download --quiet --no-deps \
    --no-build-isolation --no-binary :all: "causal-conv1d==1.6.2.post1" -d .whl
fi
ls -la .whl
