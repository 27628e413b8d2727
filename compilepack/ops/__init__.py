"""Boundary-aware sequence-mixing ops, each a ``torch.library.custom_op`` in the ``compilepack::`` namespace.

Every op has a pure-torch reference (any device; always what runs on CPU) and, on CUDA, calls the kernel
library chosen at ``patch()`` time. Importing this package registers the ops; it never imports a CUDA library.
"""

from .attention import varlen_attention
from .causal_conv1d import causal_conv1d_varlen
from .gated_delta_rule import gated_delta_rule_varlen
from .kimi_delta_attention import kimi_delta_attention_varlen
from .mamba2 import mamba2_chunk_scan_varlen
from .selective_scan import selective_scan_varlen

__all__ = [
    "causal_conv1d_varlen",
    "gated_delta_rule_varlen",
    "kimi_delta_attention_varlen",
    "mamba2_chunk_scan_varlen",
    "selective_scan_varlen",
    "varlen_attention",
]
