"""compilepack: padding-free (packed) training for Hugging Face transformers under torch.compile.

    model = compilepack.patch(model)                       # before torch.compile
    step = torch.compile(model, fullgraph=True, dynamic=True)
    loss = step(**collate(features)).loss                  # HF DataCollatorWithFlattening or PackedCollator
"""

from . import distributed, lm_head, ops
from .ops.backends import Backends
from .layout import Boundaries
from .collator import PackedCollator
from .errors import (
    BoundaryError,
    CompilepackError,
    ContextParallelError,
    IncompatibleTransformersError,
    KernelVersionError,
    PatchConflictError,
    UnsupportedModelError,
)
from .explain import CompileReport, ExplainReport, count_compiles, explain
from .integrations import to_device
from .patching import families, is_patched, patch, patched, supported_model_types, unpatch
from .validation import checked, validate

__version__ = "0.1.0"

__all__ = [
    "Backends",
    "Boundaries",
    "BoundaryError",
    "CompilepackError",
    "ContextParallelError",
    "IncompatibleTransformersError",
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
    "lm_head",
    "ops",
    "patch",
    "patched",
    "supported_model_types",
    "to_device",
    "unpatch",
    "validate",
]
