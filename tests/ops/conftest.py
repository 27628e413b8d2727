"""Fixtures the op tests share."""

from __future__ import annotations

import pytest

from tests.ops.fakes import route_kernels


@pytest.fixture
def fake_fla(monkeypatch):
    """fla modules to be faked, by name (fill in a :class:`tests.ops.fakes.fla.FakeFla`); the fla paths run on CPU."""
    fakes = {}
    route_kernels(monkeypatch, "fla", fakes)
    return fakes
