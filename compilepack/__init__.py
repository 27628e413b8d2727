"""compilepack: padding-free (packed) training for Hugging Face transformers under torch.compile.

    model = compilepack.patch(model)                       # before torch.compile
    step = torch.compile(model, fullgraph=True, dynamic=True)
    loss = step(**collate(features)).loss                  # HF DataCollatorWithFlattening or PackedCollator
"""

import warnings

from . import distributed, integrations, ops  # integrations: registers its extensions (TRL, PEFT) with patch()
from .ops.backends import Backends
from .batch import Boundaries, PackedCollator, checked, to_device, validate
from .errors import (
    BoundaryError,
    CompilepackError,
    ContextParallelError,
    IncompatibleTransformersError,
    KernelSkippedWarning,
    KernelVersionError,
    PatchConflictError,
    UnsupportedModelError,
)
from .patching import families, is_patched, patch, patched, supported_model_types, unpatch
from .testing.explain import CompileReport, ExplainReport, count_compiles, explain

__version__ = "0.1.0"

__all__ = [
    "Backends",
    "Boundaries",
    "BoundaryError",
    "CompilepackError",
    "ContextParallelError",
    "IncompatibleTransformersError",
    "KernelSkippedWarning",
    "KernelVersionError",
    "PatchConflictError",
    "UnsupportedModelError",
    "CompileReport",
    "ExplainReport",
    "PackedCollator",
    "checked",
    "count_compiles",
    "distributed",
    "explain",
    "families",
    "is_patched",
    "ops",
    "patch",
    "patched",
    "supported_model_types",
    "to_device",
    "unpatch",
    "validate",
]


def __getattr__(name: str):
    # compilepack.lm_head (the chunked-head extension) moved to compilepack.patching.chunked_head, apart from the op
    # compilepack.ops.lm_head; the old name keeps working for a deprecation period.
    if name == "lm_head":
        from .patching import chunked_head

        warnings.warn(
            "compilepack.lm_head is deprecated: the chunked LM head extension is compilepack.patching.chunked_head "
            "(turn it on with compilepack.patch(model, lm_head='chunked')).", DeprecationWarning, stacklevel=2,
        )
        return chunked_head
    raise AttributeError(f"module 'compilepack' has no attribute {name!r}")
