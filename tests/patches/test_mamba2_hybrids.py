"""Mamba2 families: what the registry-wide tests in test_families.py cannot see."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from compilepack.backends import Backends
from compilepack.patching import MAMBA2_SPLIT_CONV1D_SCAN, families, family_named
from compilepack.patching.batch import _BRIDGE
from compilepack.patching.rebind import innermost
from tests.models import build_pair, hf_batch, random_docs

LENGTHS = [70, 1, 23, 5, 1, 40]
FUSED = MAMBA2_SPLIT_CONV1D_SCAN.global_name
MAMBA2_FAMILIES = [
    pytest.param(family, id=family.name)
    for family in families()
    if any(MAMBA2_SPLIT_CONV1D_SCAN in needed for needed in family.layers.values())
]


def _fused_calls(family) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) each mixer passes to the fused-kernel global in one packed training forward on CPU."""
    _, patched = build_pair(family)
    mixers = [m for m in patched.modules() if FUSED in innermost(type(m).forward).__code__.co_names]
    assert mixers, f"{family.name}: no module calls {FUSED}"
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return None  # the stock forward then takes its unfused path

    rebound_globals = innermost(mixers[0].forward.__func__).__globals__
    patched.train()
    with mock.patch.dict(rebound_globals, {FUSED: record}):
        patched(**hf_batch(random_docs(patched.config.get_text_config().vocab_size, LENGTHS)))
    return calls


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_packed_training_never_takes_the_fused_kernel(family):
    """Even with CUDA and both kernel libraries, a packed call declines the fused kernel (it would be handed raw
    weights and bypass adapters such as LoRA on out_proj): the mixer's unfused path, with compilepack's ops, runs."""
    calls = _fused_calls(family)
    assert calls and all(kwargs.get("seq_idx") is not None for _, kwargs in calls)
    replacement = MAMBA2_SPLIT_CONV1D_SCAN.make(None, Backends(conv="causal_conv1d", ssd="mamba_ssm"))
    with mock.patch("compilepack.ops.mamba2.mamba2_split_conv1d_scan_varlen", autospec=True) as fused_op:
        for args, kwargs in calls:
            assert replacement(*args, **kwargs) is None
    assert fused_op.call_count == 0


def test_mamba2_bridge_is_removed_after_each_call():
    """Mamba2ForCausalLM hands the boundaries to its backbone through a temporary attribute: none is left behind."""
    _, patched = build_pair(family_named("mamba2"))
    batch = hf_batch(random_docs(256, LENGTHS))
    with torch.no_grad():
        patched(**batch)
        compiled = torch.compile(patched, backend="aot_eager", fullgraph=True, dynamic=True)
        compiled(**batch)
    assert _BRIDGE not in patched.backbone.__dict__
