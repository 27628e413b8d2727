"""Adapters to what users train with: collators (``collators``: boundaries for position-ids-only collators, moving
a batch while its boundaries stay on the host), TRL and HF Trainer (``trl``, ``trainer``)."""

from .collators import add_boundaries, to_device, with_boundaries

__all__ = ["add_boundaries", "to_device", "with_boundaries"]
