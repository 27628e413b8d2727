"""The batch contract, host side: what a packed batch carries, how it is built, and the rules it must satisfy.

- :mod:`.keys`: the key names (the HF collator's ``cu_seq_lens_q``, ``max_length_q``, ``seq_idx``...) and constants;
- :mod:`.derived`: what a model derives from ``cu_seqlens`` in its graph (document starts, ``seq_idx``, positions);
- :mod:`.layout`: :class:`Boundaries`, documents laid out in rows, built and checked on the host;
- :mod:`.rules`: every rule, its message, and where it is checked (host, trace time, device asserts);
- :mod:`.validation`: :func:`validate` and :func:`checked`, once per batch before the model;
- :mod:`.collators`: :class:`PackedCollator`, and the adapters for other collators (:func:`with_boundaries`,
  :func:`to_device`).

The model's side of the contract (each forward's check and device move) is :mod:`compilepack.patching.decoder`.
"""

from .collators import PackedCollator, add_boundaries, to_device, with_boundaries
from .keys import IGNORE_INDEX
from .layout import Boundaries
from .validation import checked, validate

__all__ = ["IGNORE_INDEX", "Boundaries", "PackedCollator", "add_boundaries", "checked", "to_device", "validate",
           "with_boundaries"]
