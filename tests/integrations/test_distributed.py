"""DDP and FSDP2 (``fully_shard``) on 2 CPU processes (torchrun, gloo), each with a compiled patched model.

One torchrun launch runs every case (see ``distributed_worker.py``); each rank trains on a different packed
batch. The synchronised gradients must equal one process's gradient over both batches with the same loss
normalisation: (sum of token losses of both batches) / (target tokens of both batches).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.integrations import distributed_worker as worker
from tests.models import relative_grad_error

CASES = [("ddp", "llama"), ("ddp", "qwen3_5"), ("fsdp2", "llama"), ("fsdp2", "qwen3_5")]
# relative to the largest gradient, fp32; both sides run compilepack's ops (aot_eager keeps eager's kernels), so
# only the order of additions may differ. Measured: 0.0 (bit-identical) in every case.
TOLERANCE = 1e-5
REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]


@pytest.fixture(scope="module")
def distributed_grads(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={worker.WORLD_SIZE}",
        str(Path(worker.__file__)), "--out", str(out), "--cases", ",".join(f"{m}:{f}" for m, f in CASES),
    ]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    output = f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{output}"
    return {(m, f): torch.load(out / f"{m}-{f}.pt") for m, f in CASES}


@functools.cache
def single_process_grads(family_name: str, ranks: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Gradient of the same normalised loss, in one process (eager), over the batches of ``ranks``."""
    model = worker.build_patched(family_name)
    batches = [worker.rank_batch(r, model.config.vocab_size) for r in range(worker.WORLD_SIZE)]
    all_targets = sum(worker.target_count(b) for b in batches)
    for rank in ranks:
        # world_size=1: no averaging over ranks here, so no compensating factor
        worker.rank_loss(model, batches[rank], all_targets, world_size=1).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode, family_name", CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_synchronised_gradients_equal_single_process(distributed_grads, mode, family_name):
    grads = distributed_grads[(mode, family_name)]
    reference = single_process_grads(family_name, ranks=(0, 1))
    assert grads.keys() == reference.keys()
    assert relative_grad_error(grads, reference) <= TOLERANCE
    # the comparison can fail: one rank's batch alone (no gradient synchronisation) is far off
    assert relative_grad_error(single_process_grads(family_name, ranks=(0,)), reference) > 0.05
