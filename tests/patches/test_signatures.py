"""Patched forwards keep their signatures: ``inspect.signature`` of every patched module's forward equals stock's,
annotations included (transformers' tests, ``Trainer(remove_unused_columns=True)`` and PEFT read it).

Parametrised over the registry (each family's first tiny variant), so a new family is checked without editing
this file.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import compilepack
from tests.families import available_families, build_tiny


@pytest.mark.parametrize("family", available_families(), ids=lambda family: family.name)
def test_every_patched_forward_has_the_stock_signature(family):
    torch.manual_seed(0)
    model = build_tiny(family)
    stock_signatures = {name: inspect.signature(m.forward) for name, m in model.named_modules()}
    compilepack.patch(model)
    patched = {name: m for name, m in model.named_modules() if "forward" in m.__dict__}
    assert patched, "patch() rebound no forward"
    differing = {
        f"{name} ({type(module).__name__})":
            f"patched {inspect.signature(module.forward)} != stock {stock_signatures[name]}"
        for name, module in patched.items()
        if inspect.signature(module.forward) != stock_signatures[name]
    }
    assert not differing, differing
