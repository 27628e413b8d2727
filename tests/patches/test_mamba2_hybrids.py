"""Mamba2 families: what the registry-wide tests in test_families.py cannot see."""

from __future__ import annotations

import pytest

import compilepack.ops.mamba2 as mamba2_ops
import compilepack.patching.replacements as replacements
from compilepack.ops.backends import Backends
from compilepack.patching import MAMBA2_SPLIT_CONV1D_SCAN, patch_state
from compilepack.patching.builder import _key
from compilepack.patching.rebind import private_name
from tests.families import available_families
from tests.models import build_pair, hf_batch, random_docs

LENGTHS = [70, 1, 23, 5, 1, 40]
FUSED = MAMBA2_SPLIT_CONV1D_SCAN.global_name
MAMBA2_FAMILIES = [
    pytest.param(family, id=family.name)
    for family in available_families()
    if any(MAMBA2_SPLIT_CONV1D_SCAN in needed for needed in family.layers.values())
]


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_packed_training_declines_the_fused_kernel_and_runs_compilepacks_scan(family, monkeypatch):
    """Even with CUDA and both kernel libraries, a packed call declines the fused kernel (it would be handed raw
    weights and bypass adapters such as LoRA on out_proj): the fused global is called with the boundaries and
    answers None, and the mixer's unfused path runs compilepack's boundary-aware scan, once per mixer."""
    _, patched = build_pair(family)
    modeling = __import__(family.modeling, fromlist=["_"])
    installed = private_name(_key(patch_state(patched).backends, None), FUSED)
    on_cuda = Backends({"causal_conv1d_varlen": "causal_conv1d", "mamba2_chunk_scan_varlen": "mamba_ssm"})
    cuda_backends = MAMBA2_SPLIT_CONV1D_SCAN.make(modeling.__dict__[FUSED], on_cuda, None)
    answers, scans = [], []

    def fused(*args, **kwargs):
        answers.append((kwargs.get("seq_idx") is not None, cuda_backends(*args, **kwargs)))
        return answers[-1][1]

    scan = mamba2_ops.mamba2_chunk_scan_varlen
    monkeypatch.setitem(modeling.__dict__, installed, fused)
    # the replacement calls the op through replacements.py's module global (imported there at the top)
    monkeypatch.setattr(replacements, "mamba2_chunk_scan_varlen", lambda *a, **k: scans.append(1) or scan(*a, **k))
    patched.train()
    patched(**hf_batch(random_docs(patched.config.get_text_config().vocab_size, LENGTHS)))
    mixer_classes = {name for name, needed in family.layers.items() if MAMBA2_SPLIT_CONV1D_SCAN in needed}
    mixers = sum(1 for m in patched.modules() if type(m).__name__ in mixer_classes)
    assert answers and answers == [(True, None)] * len(answers)
    assert len(scans) == mixers == len(answers)
