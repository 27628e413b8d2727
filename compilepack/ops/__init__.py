"""Boundary-aware sequence-mixing ops, each a ``torch.library.custom_op`` in the ``compilepack::`` namespace."""
