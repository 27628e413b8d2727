"""Counting compiles in tests."""

from __future__ import annotations

import contextlib

import torch._dynamo.utils


@contextlib.contextmanager
def graphs_compiled():
    """Yields a callable returning how many graphs dynamo compiled since entering.

    Counts compiled graphs rather than backend calls: when dynamo restarts the analysis of one frame (after
    specialising a float argument, say) the backend may be called twice for what is still one compile.
    """
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    yield lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
