"""Boundary-aware sequence-mixing ops, each a ``torch.library.custom_op`` in the ``compilepack::`` namespace.

Every op has a pure-torch reference (any device; always what runs on CPU) and, on CUDA, calls the kernel
library chosen at ``patch()`` time. Importing this package registers the ops; it never imports a CUDA library.
"""

from .attention import varlen_attention

__all__ = ["varlen_attention"]
