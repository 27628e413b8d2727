"""Errors compilepack raises. Each message names what was wrong, what was expected, and how to fix it."""

from __future__ import annotations


class CompilepackError(Exception):
    """Base class of compilepack's own errors."""


class BoundaryError(CompilepackError, ValueError):
    """A packed batch whose boundaries are missing, malformed or inconsistent with its tokens."""


class UnsupportedModelError(CompilepackError, ValueError):
    """``patch()`` was given a model family compilepack has no patch for."""


class IncompatibleTransformersError(CompilepackError, RuntimeError):
    """The installed transformers does not have the functions/classes a patch replaces, as it expects them."""


class PatchConflictError(CompilepackError, RuntimeError):
    """The model is already compiled, or a module's forward was already replaced by another tool."""


class ContextParallelError(CompilepackError, ValueError):
    """A model or batch that cannot run under the requested context parallelism."""


class KernelVersionError(CompilepackError, ValueError):
    """A kernel library asked for by name is refused on this machine (below its floor,
    ``compilepack.ops.backends.FLOORS``, or known wrong on this GPU and compiler): upgrade it, or choose another
    backend."""


class KernelSkippedWarning(UserWarning):
    """``backend="auto"`` passed over an installed kernel library that compilepack refuses on this machine, and runs
    the next admitted one; the message names each, why, and the fix."""
