"""Recording stand-ins for the CUDA kernel libraries, to drive the ops' kernel paths on CPU.

Each fake checks the argument contract the op's glue must honour (layouts, dtypes, Python ints, the host copy of
the boundaries) and returns results from compilepack's own reference, so a path's wiring (what is saved, what is
handed back, how gradients map to inputs) is tested without the library. ``route_kernels`` points the ops at a
fake: the device test in ``backends.use_kernel`` is replaced, and ``backends.load`` returns the fake for its module.
"""

from __future__ import annotations

import pytest

from compilepack.ops import backends


def route_kernels(monkeypatch: pytest.MonkeyPatch, backend: str, modules: dict) -> list[str]:
    """Make ops run their ``backend`` path on CPU tensors, with ``backends.load(name)`` answering from ``modules``
    (module name -> fake). Returns the list of module names loaded, in order."""
    loaded: list[str] = []

    def load(name: str):
        loaded.append(name)
        if name not in modules:
            raise AssertionError(f"unexpected kernel module load: {name}")
        return modules[name]

    monkeypatch.setattr(backends, "use_kernel", lambda tensor, chosen: chosen == backend)
    monkeypatch.setattr(backends, "load", load)
    return loaded
