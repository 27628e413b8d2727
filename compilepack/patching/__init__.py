"""Patching machinery: family declarations, their registry, the builder of their forwards, and the per-instance
rebinding of transformers forwards."""

from .api import is_patched, patch, patch_state, patched, unpatch
from . import chunked_head  # registers patch(lm_head=...) with patch(): importing compilepack must be enough
from .builder import build_forwards
from .family import Checkpoint, DocsRow, Family, Fixtures, TinyModel
from .registry import families, family_named, family_of, register, supported_model_types
from .replacements import (
    ATTENTION,
    CAUSAL_CONV1D,
    GATED_DELTA_RULE,
    GATED_DELTANET,
    KIMI_DELTA_ATTENTION,
    KIMI_DELTA_MIXER,
    MAMBA1_FUSED_MIXER,
    MAMBA1_MIXER,
    MAMBA2_CHUNK_SCAN,
    MAMBA2_MIXER,
    MAMBA2_SPLIT_CONV1D_SCAN,
    MAMBA_INNER,
    SELECTIVE_SCAN,
    Replacement,
)

__all__ = [
    "ATTENTION",
    "CAUSAL_CONV1D",
    "GATED_DELTA_RULE",
    "GATED_DELTANET",
    "KIMI_DELTA_ATTENTION",
    "KIMI_DELTA_MIXER",
    "MAMBA1_FUSED_MIXER",
    "MAMBA1_MIXER",
    "MAMBA2_CHUNK_SCAN",
    "MAMBA2_MIXER",
    "MAMBA2_SPLIT_CONV1D_SCAN",
    "MAMBA_INNER",
    "SELECTIVE_SCAN",
    "Checkpoint",
    "DocsRow",
    "Family",
    "Fixtures",
    "Replacement",
    "TinyModel",
    "build_forwards",
    "families",
    "family_named",
    "family_of",
    "is_patched",
    "patch",
    "patch_state",
    "patched",
    "register",
    "supported_model_types",
    "unpatch",
]
