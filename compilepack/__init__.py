"""compilepack: padding-free (packed) training for Hugging Face transformers under torch.compile.

    model = compilepack.patch(model)                       # before torch.compile
    step = torch.compile(model, fullgraph=True, dynamic=True)
    loss = step(**collate(features)).loss                  # HF DataCollatorWithFlattening or PackedCollator
"""

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

