"""Which kernel library each op uses on CUDA, decided once at ``patch()`` time.

Every op has a pure-torch reference that runs on any device and is always what runs on CPU. On CUDA an op
uses the library named here when it is installed. Libraries are imported lazily, on first use, so importing
compilepack never imports a CUDA-only package.

A library older than its floor (``FLOORS``: the oldest release without a reported varlen bug that compilepack
cannot guard against, see docs/kernels.md) is refused when it would be chosen, with the version found and the fix.
Its version is read from the installed package's metadata, without importing it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import sys
import warnings
from types import ModuleType

from packaging.version import InvalidVersion, Version

from ..errors import KernelVersionError

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
    # seen on the lent H200 (2026-12-04): torch 2.11's op takes 10 arguments, and the call failed on every layout
    "torch_varlen": Floor(
        ("torch",), "2.13.0",
        "the private ops torch.ops.torch_attn._varlen_attn / _varlen_attn_backward take the window and GQA "
        "arguments compilepack passes from torch 2.13 (torch 2.11's forward takes 10 arguments)",
        "pip install -U 'torch>=2.13'",
    ),
}

# fla's gated backward (chunk_bwd_dqkwg) is wrong on Hopper with Triton >= 3.4.0 and < 3.7.1 (fla #640), and fla
# raises there, at the first backward, unless tilelang is installed; compilepack refuses it at patch() time instead
# (seen on the lent H200, 2026-12-04: Triton 3.6.0, every gated-delta-rule layout refused by fla in the backward)
_FLA_HOPPER_TRITON = (Version("3.4.0"), Version("3.7.1"))


def _without(kind: str, backend: str) -> str:
    """How to run op kind ``kind`` without ``backend``: the next candidate (named in refusals)."""
    candidates = CANDIDATES[kind]
    return candidates[candidates.index(backend) + 1]


# old names -> new names, accepted with a DeprecationWarning: op kinds in ``backend={...}``, ``Backends`` keywords
DEPRECATED_KINDS = {"gated_delta": "delta_rule"}
_DEPRECATED_FIELDS = {**DEPRECATED_KINDS, "context_parallel": "cp_group"}


def _warn_renamed(old: str, new: str, where: str) -> None:
    warnings.warn(f"{where}: {old!r} is deprecated, use {new!r}.", DeprecationWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True, init=False)
class Backends:
    """The backend of each op kind (a name from ``CANDIDATES``), used when the op's tensors are on CUDA.

    ``Backends(gated_delta=...)`` and ``Backends(context_parallel=...)`` (the old names of ``delta_rule`` and
    ``cp_group``) still work, with a DeprecationWarning."""

    attention: str = REFERENCE
    conv: str = REFERENCE
    delta_rule: str = REFERENCE
    ssd: str = REFERENCE
    # compilepack.distributed.ContextParallel when patched with context_parallel=: every sequence mixer then runs
    # head-parallel between two all-to-alls over its group, over tokens, or both, as its mode says (None: no context
    # parallelism)
    cp_group: object = None

    def __init__(self, attention: str = REFERENCE, conv: str = REFERENCE, delta_rule: str = REFERENCE,
                 ssd: str = REFERENCE, cp_group: object = None, **deprecated):
        unknown = set(deprecated) - set(_DEPRECATED_FIELDS)
        if unknown:
            raise TypeError(f"Backends() got unexpected keywords {sorted(unknown)}.")
        for old, value in deprecated.items():
            _warn_renamed(old, _DEPRECATED_FIELDS[old], "Backends()")
        delta_rule = deprecated.get("gated_delta", delta_rule)
        cp_group = deprecated.get("context_parallel", cp_group)
        for name, value in (("attention", attention), ("conv", conv), ("delta_rule", delta_rule), ("ssd", ssd),
                            ("cp_group", cp_group)):
            object.__setattr__(self, name, value)  # frozen

    @property
    def gated_delta(self) -> str:
        _warn_renamed("gated_delta", "delta_rule", "Backends")
        return self.delta_rule

    @property
    def context_parallel(self) -> object:
        _warn_renamed("context_parallel", "cp_group", "Backends")
        return self.cp_group

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


def check_floor(backend: str, kind: str) -> None:
    """Refuse ``backend`` for op kind ``kind`` when its installed release is older than its floor, or unknown."""
    floor = FLOORS.get(backend)
    if floor is None:
        return
    found = installed_version(backend)
    try:
        admitted = found is not None and Version(found) >= Version(floor.version)
    except InvalidVersion:
        admitted = False
    if admitted:
        return
    seen = f"{floor.distributions[0]} {found} is installed" if found else (
        f"the version of the installed {backend} cannot be read (no {floor.distributions[0]} package metadata)")
    raise KernelVersionError(
        f"compilepack refuses {backend} for {kind!r} on CUDA: {seen}, and compilepack needs "
        f"{floor.distributions[0]} >= {floor.version} ({floor.why}). Fix: {floor.upgrade}, or run without it: "
        f"compilepack.patch(model, backend={{{kind!r}: {_without(kind, backend)!r}}}). See docs/kernels.md."
    )


def check_platform(backend: str, kind: str) -> None:
    """Refuse ``backend`` where the library is known to be wrong on this machine's GPU and compiler (fla's gated
    backward on Hopper with Triton 3.4 to 3.7.0, fla #640), read from the first visible CUDA device; nothing to check
    without CUDA."""
    if backend != "fla" or not _cuda_capability_major() == 9 or is_importable("tilelang"):
        return
    triton = _distribution_version("triton")
    low, high = _FLA_HOPPER_TRITON
    if triton is not None and low <= triton < high:
        raise KernelVersionError(
            f"compilepack refuses fla for {kind!r} on this Hopper GPU: Triton {triton} is installed, and fla's gated "
            f"backward (chunk_bwd_dqkwg, used by the gated delta rule) is wrong with Triton >= {low} and < {high} on "
            f"Hopper (fla #640; fla raises at the first backward). Fix: pip install -U 'triton>={high}' (with a torch "
            "built for it), or pip install tilelang, or run without fla: "
            f"compilepack.patch(model, backend={{{kind!r}: {_without(kind, backend)!r}}}). See docs/kernels.md."
        )


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


def resolve(backend: str | dict[str, str] | Backends = "auto") -> Backends:
    """Turn the user's ``backend=`` argument into a :class:`Backends`.

    ``"auto"`` picks, per op kind, the first installed candidate; ``"reference"`` forces the pure-torch
    reference everywhere; a dict overrides single kinds (``{"attention": "torch_varlen"}``), the rest auto.
    A chosen library installed below its floor (``FLOORS``) raises :class:`KernelVersionError`, auto or not: an
    old kernel is never used silently, and never silently swapped for another.
    """
    if isinstance(backend, Backends):
        return backend
    if backend == REFERENCE:
        return Backends()
    overrides: dict[str, str] = {}
    if isinstance(backend, dict):
        overrides = {_current_kind(kind): name for kind, name in backend.items()}
    elif backend != "auto":
        raise ValueError(
            f"backend={backend!r} is not understood: expected 'auto', 'reference', a dict such as "
            f"{{'attention': 'torch_varlen'}}, or a compilepack.ops.backends.Backends."
        )
    chosen = {}
    for kind, candidates in CANDIDATES.items():
        if kind in overrides:
            name = overrides.pop(kind)
            if name not in candidates:
                raise ValueError(f"backend for {kind!r} must be one of {candidates}, got {name!r}.")
            if not is_installed(name):
                raise ValueError(f"backend {name!r} for {kind!r} is not installed; install it or use 'auto'.")
            chosen[kind] = name
        else:
            chosen[kind] = next(name for name in candidates if is_installed(name))
        check_floor(chosen[kind], kind)
        check_platform(chosen[kind], kind)
    if overrides:
        raise ValueError(f"unknown op kinds in backend=: {sorted(overrides)}; expected {sorted(CANDIDATES)}.")
    return Backends(**chosen)


def _current_kind(kind: str) -> str:
    """An op kind of ``backend={...}``, its old name (``DEPRECATED_KINDS``) replaced with a DeprecationWarning."""
    if kind in DEPRECATED_KINDS:
        _warn_renamed(kind, DEPRECATED_KINDS[kind], "backend={...}")
        return DEPRECATED_KINDS[kind]
    return kind


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
