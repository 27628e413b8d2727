"""FSDP2 in the sequence and hybrid modes (docs/context-parallel-evidence.md, "FSDP2 in the sequence and hybrid modes"):
4 gloo processes, parameters sharded by ``fully_shard`` over all 4, the world one context-parallel group (sequence over
4; hybrid: Ulysses over 2 x sequence over 2), configs with 2 query heads and 1 kv head. The gradient is one process's
within the families' 1e-4 (relative to the largest gradient entry); the control (state pass and halo skipped) misses by
0.05 at least.

In the cp8 stage: ``COMPILEPACK_CP8=1 python -m pytest -q -p no:cacheprovider -m cp8 tests/distributed``.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests.distributed import worker

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.skipif(os.environ.get("COMPILEPACK_CP8") != "1",
                       reason="the cp8 stage: COMPILEPACK_CP8=1 python -m pytest -m cp8 tests/distributed"),
    pytest.mark.cp8, pytest.mark.slow, pytest.mark.multiprocess,
]

CASES = [(family, mode) for family in ("qwen3_5", "bamba") for mode in ("sequence", "hybrid")]
TOLERANCE, CONTROL_MISS = 1e-4, 0.05


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    checks = [("fsdp_modes_worker.fsdp_equality", family, mode) for family, mode in CASES]
    results = worker.spawn(4, checks, tmp_path_factory.mktemp("fsdp-modes"))
    failed = {key: value["error"] for key, value in results.items() if "error" in value}
    assert not failed, "\n".join(f"{key}:\n{error}" for key, error in failed.items())
    return results


@pytest.mark.parametrize("family, mode", CASES)
def test_fsdp2_in_the_sequence_and_hybrid_modes_equals_one_process(world4, family, mode):
    figures = world4[f"fsdp_modes_worker.fsdp_equality:{family}:{mode}"]
    assert figures["sharded"], figures
    assert figures["grads"] <= TOLERANCE, figures
    assert figures["control_no_pass"] >= CONTROL_MISS, figures
