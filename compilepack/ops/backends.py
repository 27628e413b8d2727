"""Which kernel library each op uses on CUDA, decided once at ``patch()`` time.

Every op has a pure-torch reference that runs on any device and is always what runs on CPU. On CUDA an op
uses the library named here when it is installed. Libraries are imported lazily, on first use, so importing
compilepack never imports a CUDA-only package.

A library older than its floor (``FLOORS``: the oldest release without a reported varlen bug that compilepack
cannot guard against, see docs/kernels.md), or one known to be wrong on this GPU and compiler, is refused: skipped
with a warning under ``"auto"``, an error when asked for by name. Only the op kinds a model's family uses are
resolved and checked. Versions are read from installed packages' metadata, without importing them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from packaging.version import InvalidVersion, Version

from ..errors import KernelSkippedWarning, KernelVersionError

REFERENCE = "reference"

# op kind -> candidate backends on CUDA, best first. "torch_varlen" is torch's own varlen attention.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "attention": ("flash_attn", "torch_varlen", REFERENCE),
    "conv": ("causal_conv1d", REFERENCE),
    "delta_rule": ("fla", REFERENCE),  # the gated delta rule and Kimi delta attention
    "ssd": ("mamba_ssm", REFERENCE),
}

# backend name -> importable module that proves it is installed
_PROBE_MODULE = {
    "flash_attn": "flash_attn",
    "torch_varlen": "torch.nn.attention.varlen",
    "causal_conv1d": "causal_conv1d",
    "fla": "fla",
    "mamba_ssm": "mamba_ssm",
    REFERENCE: None,
}


@dataclasses.dataclass(frozen=True)
class Floor:
    """The oldest release of a kernel library compilepack admits on CUDA, and why (docs/kernels.md has the table)."""

    distributions: tuple[str, ...]  # the pip distributions that install the module, the first one named in messages
    version: str
    why: str
    upgrade: str  # the pip command that fixes it


FLOORS: dict[str, Floor] = {
    "flash_attn": Floor(
        ("flash-attn",), "2.7.0",
        "the varlen forward/backward compilepack calls take their window and softcap arguments as in 2.7",
        "pip install -U 'flash-attn>=2.7'",
    ),
    "causal_conv1d": Floor(
        ("causal-conv1d",), "1.5.1",
        "the backward compilepack calls (causal_conv1d.cpp_functions) exists from 1.5.1",
        "pip install -U 'causal-conv1d>=1.5.1'",
    ),
    "fla": Floor(
        ("fla-core", "flash-linear-attention"), "0.6.0",
        "0.5.x computes the chunk kernels' offsets in int32, wrong or illegal reads on long rows (fixed by fla "
        "#1082), and does not import under triton 3.9",
        "pip install -U 'fla-core>=0.6' 'flash-linear-attention>=0.6'",
    ),
    "mamba_ssm": Floor(
        ("mamba-ssm",), "2.2.3",
        "the chunk-scan backward before 2.2.3 gives wrong gradients or illegal memory accesses (mamba #537)",
        "pip install -U 'mamba-ssm>=2.2.3'",
    ),
    # torch 2.10's ops take no scale and no window; each later release's own signature is called (torch_varlen.py)
    "torch_varlen": Floor(
        ("torch",), "2.11.0",
        "the private ops torch.ops.torch_attn._varlen_attn / _varlen_attn_backward take the scale and window "
        "compilepack passes from torch 2.11",
        "pip install -U 'torch>=2.11'",
    ),
}

# fla's gated backward (chunk_bwd_dqkwg) is wrong on Hopper with Triton >= 3.4.0 and < 3.7.1 (fla #640), and fla
# raises there, at the first backward, unless its TileLang backward runs (fla_tilelang_runs); compilepack refuses it
# at patch() time instead (seen on the lent H200, 2026-12-04: Triton 3.6.0, every gated-delta-rule layout refused by
# fla in the backward)
_FLA_HOPPER_TRITON = (Version("3.4.0"), Version("3.7.1"))


@dataclasses.dataclass(frozen=True)
class Backends:
    """The backend of each op kind (a name from ``CANDIDATES``), used when the op's tensors are on CUDA."""

    attention: str = REFERENCE
    conv: str = REFERENCE
    delta_rule: str = REFERENCE
    ssd: str = REFERENCE
    # compilepack.distributed.ContextParallel when patched with context_parallel=: every sequence mixer then runs
    # head-parallel between two all-to-alls over its group, over tokens, or both, as its mode says (None: no context
    # parallelism)
    cp_group: object = None

    def describe(self) -> str:
        kinds = [f.name for f in dataclasses.fields(self) if f.name != "cp_group"]
        text = ", ".join(f"{kind}={getattr(self, kind)}" for kind in kinds)
        if self.cp_group is not None:
            text += f", cp_group={self.cp_group.describe()}"
        return text


def is_installed(backend: str) -> bool:
    """True when the backend's package can be imported (checked without importing it)."""
    module = _PROBE_MODULE[backend]
    return module is None or is_importable(module)


def installed_version(backend: str) -> str | None:
    """The installed release of a kernel library (from its package metadata, not importing it); None if unknown."""
    for distribution in FLOORS[backend].distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why ``backend`` cannot run op kind ``kind`` on this machine, and the fix on the library's side."""

    kind: str
    backend: str
    why: str  # what was found and what compilepack needs
    fix: str  # the install that fixes it

    def describe(self) -> str:
        return f"{self.backend} for {self.kind!r}: {self.why}. Fix: {self.fix}"


def refusal(backend: str, kind: str) -> Refusal | None:
    """Why ``backend`` is refused for ``kind`` here (below its floor, or wrong on this GPU and compiler); None when
    it is admitted. Read from package metadata and the first CUDA device, never by importing the library."""
    return _below_floor(backend, kind) or _wrong_on_this_platform(backend, kind)


def _below_floor(backend: str, kind: str) -> Refusal | None:
    floor = FLOORS.get(backend)
    if floor is None:
        return None
    found = installed_version(backend)
    try:
        admitted = found is not None and Version(found) >= Version(floor.version)
    except InvalidVersion:
        admitted = False
    if admitted:
        return None
    seen = f"{floor.distributions[0]} {found} is installed" if found else (
        f"the version of the installed {backend} cannot be read (no {floor.distributions[0]} package metadata)")
    return Refusal(kind, backend, f"{seen}, and compilepack needs {floor.distributions[0]} >= {floor.version} "
                   f"({floor.why})", floor.upgrade)


def _wrong_on_this_platform(backend: str, kind: str) -> Refusal | None:
    """fla's gated backward on Hopper with Triton 3.4 to 3.7.0 (fla #640), where fla itself would raise: that is,
    unless fla's TileLang kernel replaces the Triton one (:func:`fla_tilelang_runs`)."""
    if backend != "fla" or _cuda_capability_major() != 9 or fla_tilelang_runs():
        return None
    triton = _distribution_version("triton")
    low, high = _FLA_HOPPER_TRITON
    if triton is None or not low <= triton < high:
        return None
    return Refusal(kind, backend, (
        f"Triton {triton} is installed, and fla's gated backward (chunk_bwd_dqkwg, used by the gated delta rule) is "
        f"wrong with Triton >= {low} and < {high} on Hopper (fla #640; fla raises at the first backward), and fla's "
        f"TileLang replacement of it does not run here ({_why_no_tilelang()})"
    ), f"pip install -U 'torch>=2.12.1' (it pins Triton {high}), or make fla's TileLang kernel run ({_TILELANG_FIX})")


_TILELANG_FIX = "pip install tilelang, with nvcc on PATH or CUDA_HOME set, FLA_TILELANG and " \
    "FLA_DISABLE_BACKEND_DISPATCH unset"


def fla_tilelang_runs() -> bool:
    """Whether fla 0.6 dispatches its gated backward to TileLang instead of the Triton kernel #640 breaks: the
    condition fla itself checks (``fla/backends.py``: ``TileLangBackend.is_available`` and ``is_enabled``, and the
    dispatch switch), read without importing fla."""
    return _why_no_tilelang() is None


def _why_no_tilelang() -> str | None:
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return "FLA_DISABLE_BACKEND_DISPATCH=1 bypasses fla's backends"
    if os.environ.get("FLA_TILELANG") == "0":
        return "FLA_TILELANG=0 turns it off"
    if not is_importable("tilelang"):
        return "tilelang is not installed"
    if not has_usable_nvcc():
        return "tilelang is installed, but no nvcc is found for its JIT"
    return None


def has_usable_nvcc() -> bool:
    """Where fla 0.6's ``has_usable_nvcc`` (``fla/utils/env.py``) finds an nvcc for TileLang's JIT, in its order:
    ``$CUDA_HOME/bin`` or ``$CUDA_PATH/bin``, ``PATH``, the ``nvidia-cuda-nvcc`` wheel, ``/usr/local/cuda/bin``."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is not None and _is_file(Path(home) / "bin" / "nvcc"):
        return True
    if shutil.which("nvcc") is not None:
        return True
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    return any(f.name == "nvcc" for f in files) or _is_file(Path("/usr/local/cuda/bin/nvcc"))


def _is_file(path: Path) -> bool:
    return path.exists()


def _cuda_capability_major() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0]


def is_importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _distribution_version(distribution: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(distribution))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def resolve(backend: str | dict[str, str] | Backends = "auto", kinds: Iterable[str] | None = None) -> Backends:
    """Turn the user's ``backend=`` argument into a :class:`Backends`, for the op kinds ``kinds`` (those a model's
    family uses; None: every kind). Kinds outside ``kinds`` stay on the reference and are never checked: a model is
    not refused for an op it does not run.

    ``"auto"`` picks, per op kind, the first installed candidate that compilepack admits here; a candidate it refuses
    (``refusal``: below its floor, or wrong on this GPU) is skipped, with one :class:`KernelSkippedWarning` naming
    every skipped one, why, and the fix. ``"reference"`` forces the pure-torch reference everywhere; a dict names
    single kinds (``{"attention": "torch_varlen"}``), the rest auto. A library named explicitly that compilepack
    refuses raises :class:`KernelVersionError`, one error naming every refused kind: an old or broken kernel is
    never used silently, and one asked for is never silently swapped for another.
    """
    if isinstance(backend, Backends):
        return backend
    if backend == REFERENCE:
        return Backends()
    used = tuple(CANDIDATES) if kinds is None else tuple(dict.fromkeys(kinds))
    overrides = _overrides(backend)
    chosen, refused, skipped = {}, [], []
    for kind in used:
        if kind in overrides:
            chosen[kind] = overrides[kind]
            refused += [r for r in [refusal(overrides[kind], kind)] if r]
        else:
            chosen[kind], passed_over = best_admitted(kind)
            skipped += passed_over
    _raise_refused(refused)
    if skipped:  # one warning for all of them; Python's filters show it once per place patch() is called from
        warnings.warn(_skipped_message(skipped, chosen), KernelSkippedWarning, stacklevel=3)
    return Backends(**chosen)


def _overrides(backend: str | dict[str, str]) -> dict[str, str]:
    """``backend=``'s per-kind choices, each checked to be a candidate of a known kind and installed."""
    if backend == "auto":
        return {}
    if not isinstance(backend, dict):
        raise ValueError(
            f"backend={backend!r} is not understood: expected 'auto', 'reference', a dict such as "
            f"{{'attention': 'torch_varlen'}}, or a compilepack.ops.backends.Backends."
        )
    overrides = dict(backend)
    unknown = sorted(set(overrides) - set(CANDIDATES))
    if unknown:
        raise ValueError(f"unknown op kinds in backend=: {unknown}; expected {sorted(CANDIDATES)}.")
    for kind, name in overrides.items():
        if name not in CANDIDATES[kind]:
            raise ValueError(f"backend for {kind!r} must be one of {CANDIDATES[kind]}, got {name!r}.")
        if not is_installed(name):
            raise ValueError(f"backend {name!r} for {kind!r} is not installed; install it or use 'auto'.")
    return overrides


def best_admitted(kind: str, after: str | None = None) -> tuple[str, list[Refusal]]:
    """The first installed candidate for ``kind`` (past ``after`` when given) that compilepack admits here, and the
    installed ones it refused on the way. The reference is always admitted."""
    candidates = CANDIDATES[kind]
    start = 0 if after is None else candidates.index(after) + 1
    passed_over = []
    for name in candidates[start:]:
        if not is_installed(name):
            continue
        refused = refusal(name, kind)
        if refused is None:
            return name, passed_over
        passed_over.append(refused)
    raise AssertionError(f"no admitted backend for {kind!r}")  # unreachable: the reference is last


def _raise_refused(refused: list[Refusal]) -> None:
    if not refused:
        return
    instead = {r.kind: best_admitted(r.kind, after=r.backend)[0] for r in refused}
    libraries = "a kernel library" if len(refused) == 1 else f"{len(refused)} kernel libraries"
    raise KernelVersionError(
        f"compilepack refuses {libraries} asked for on this machine (CUDA): "
        + "; ".join(r.describe() for r in refused)
        + f". Or run without {'it' if len(refused) == 1 else 'them'}: compilepack.patch(model, backend={instead!r}). "
        "See docs/kernels.md."
    )


def _skipped_message(skipped: list[Refusal], chosen: dict[str, str]) -> str:
    parts = [f"{r.describe()} (runs {chosen[r.kind]!r} instead)" for r in skipped]
    settle = {r.kind: chosen[r.kind] for r in skipped}
    return (
        "compilepack skipped kernel libraries it refuses on this machine (CUDA): " + "; ".join(parts)
        + f". To choose this explicitly (and silence this warning): compilepack.patch(model, backend={settle!r}). "
        "See docs/kernels.md."
    )


@functools.cache
def load(module_name: str) -> ModuleType:
    """Import a kernel module on first use (never at compilepack import time).

    mamba-ssm installed without its CUDA extensions (``MAMBA_SKIP_CUDA_BUILD=TRUE``: machines that cannot compile
    them) has usable Triton kernels under ``mamba_ssm.ops.triton``, but its package ``__init__`` imports the
    selective-scan extension and fails. Such a module is then imported without running the ``__init__`` files of
    its parent packages (see :func:`_import_past_package_inits`).
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        top = module_name.split(".")[0]
        if top != "mamba_ssm" or error.name is None or error.name.split(".")[0] == top:
            raise
        return _import_past_package_inits(module_name)


def _import_past_package_inits(module_name: str) -> ModuleType:
    """Import ``module_name`` after registering its parent packages as empty packages (their ``__path__`` only).

    The parents' ``__init__`` code never runs: ``import mamba_ssm`` then gives that empty package rather than
    failing, and ``mamba_ssm.Mamba`` and the other names its ``__init__`` would import are absent.
    """
    parts = module_name.split(".")
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)  # its parent, already registered, is not executed again
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"cannot import {module_name}: {name} is not a package")
        package = importlib.util.module_from_spec(spec)  # created, not executed
        sys.modules[name] = package
        if depth > 1:
            setattr(sys.modules[".".join(parts[: depth - 1])], parts[depth - 1], package)
    return importlib.import_module(module_name)


def use_kernel(tensor, backend: str) -> bool:
    """Whether an op call runs the CUDA library ``backend`` rather than the reference.

    Decided from static facts only (device type, the backend name chosen at patch time), so it never
    branches on tensor data. Tests replace this function to drive the kernel paths on CPU with fakes.
    """
    return backend != REFERENCE and tensor.device.type == "cuda"
