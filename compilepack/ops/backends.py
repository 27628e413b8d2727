"""Which kernel library each op uses on CUDA, decided once at ``patch()`` time.

Every op has a pure-torch reference that runs on any device and is always what runs on CPU. On CUDA an op
uses the library named here when it is installed. Libraries are imported lazily, on first use, so importing
compilepack never imports a CUDA-only package.

A library older than its floor (``FLOORS``: the oldest release without a reported varlen bug that compilepack
cannot guard against, see docs/kernels.md), or one known to be wrong on this GPU and compiler for an op, is refused:
skipped with a warning under ``"auto"``, an error when asked for by name. Each op declares its libraries where it is
defined (``define_op(kernels=...)``); only the ops a model's family runs are resolved and checked. Versions are read
from installed packages' metadata, without importing them.
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
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

from packaging.version import InvalidVersion, Version

from ..errors import KernelSkippedWarning, KernelVersionError

REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class OpKernels:
    """What one op's ``define_op(kernels=...)`` declared: its CUDA candidates, best first, the reference last, and
    the op kind (``"attention"``, ``"conv"``, ``"delta_rule"``, ``"ssd"``) that ``patch(backend={kind: ...})``
    names it by together with the other ops the same libraries serve (None: an op without a kernel)."""

    candidates: tuple[str, ...]
    kind: str | None


# op name (``compilepack::<name>``) -> its kernels; filled by ``define_op`` when compilepack.ops is imported (which
# importing this module does first: it is compilepack.ops' submodule)
OPS: dict[str, OpKernels] = {}


def declare(op: str, kernels: Iterable[str], kind: str | None) -> None:
    """Record ``op``'s kernel libraries (best first) and its kind. The helper forms of an op (its ``_kv`` and
    ``_state`` ops) follow the op's choice: they declare the same libraries, and its kind or none."""
    declared = OpKernels((*kernels, REFERENCE), kind)
    first = OPS.setdefault(op, declared)
    if first.candidates != declared.candidates or kind not in (None, first.kind):
        raise TypeError(f"op {op!r} is declared twice, differently: {first} and {declared}.")


def candidates(op: str) -> tuple[str, ...]:
    """The backends ``op`` can run on CUDA, best first, the reference last."""
    return _kernels(op).candidates


def ops_of_kind(kind: str) -> tuple[str, ...]:
    """The ops a kind names in ``patch(backend={kind: ...})``, in declaration order."""
    return tuple(op for op, declared in OPS.items() if declared.kind == kind)


def kinds() -> tuple[str, ...]:
    return tuple(dict.fromkeys(declared.kind for declared in OPS.values() if declared.kind is not None))


def _kernels(op: str) -> OpKernels:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; compilepack's ops are {sorted(OPS)}.") from None


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
# the ops whose fla backward calls chunk_bwd_dqkwg with a gate: the gated delta rule's. KDA's backward has its own
# kernels (fla/ops/kda) and passed every layout on that H200, so Kimi Linear keeps fla there
_FLA_640_OPS = frozenset({"gated_delta_rule_varlen"})


class Backends:
    """The backend each op runs on CUDA (op name -> one of its :func:`candidates`), chosen once at ``patch()`` time;
    an op not named runs its reference. Immutable and hashable: patched forwards are built once per choice."""

    __slots__ = ("_choices",)

    def __init__(self, choices: Mapping[str, str] | None = None):
        choices = dict(choices or {})
        for op, backend in choices.items():
            if backend not in candidates(op):
                raise ValueError(f"backend for {op!r} must be one of {candidates(op)}, got {backend!r}.")
        self._choices = tuple(sorted((op, b) for op, b in choices.items() if b != REFERENCE))

    def __getitem__(self, op: str) -> str:
        _kernels(op)  # an op name nothing declared is a typo, never silently the reference
        return dict(self._choices).get(op, REFERENCE)

    def __eq__(self, other) -> bool:
        return isinstance(other, Backends) and self._choices == other._choices

    def __hash__(self) -> int:
        return hash(self._choices)

    def __reduce__(self):
        return Backends, (dict(self._choices),)

    def __repr__(self) -> str:
        return f"Backends({dict(self._choices)!r})"

    def describe(self) -> str:
        return ", ".join(f"{op}={backend}" for op, backend in self._choices) or "the references everywhere"


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
    """Why ``backend`` cannot run ``op`` on this machine, and the fix on the library's side."""

    op: str
    backend: str
    why: str  # what was found and what compilepack needs
    fix: str  # the install that fixes it


def refusal(backend: str, op: str) -> Refusal | None:
    """Why ``backend`` is refused for ``op`` here (below its floor, or wrong on this GPU and compiler); None when
    it is admitted. Read from package metadata and the first CUDA device, never by importing the library."""
    return _below_floor(backend, op) or _wrong_on_this_platform(backend, op)


def _below_floor(backend: str, op: str) -> Refusal | None:
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
    return Refusal(op, backend, f"{seen}, and compilepack needs {floor.distributions[0]} >= {floor.version} "
                   f"({floor.why})", floor.upgrade)


def _wrong_on_this_platform(backend: str, op: str) -> Refusal | None:
    """fla's gated backward on Hopper with Triton 3.4 to 3.7.0 (fla #640), where fla itself would raise: that is,
    unless fla's TileLang kernel replaces the Triton one (:func:`fla_tilelang_runs`)."""
    if backend != "fla" or op not in _FLA_640_OPS or _cuda_capability_major() != 9 or fla_tilelang_runs():
        return None
    triton = _distribution_version("triton")
    low, high = _FLA_HOPPER_TRITON
    if triton is None or not low <= triton < high:
        return None
    return Refusal(op, backend, (
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


def resolve(backend: str | dict[str, str] | Backends = "auto", ops: Iterable[str] | None = None) -> Backends:
    """Turn the user's ``backend=`` argument into a :class:`Backends`, for the ops ``ops`` (those a model's family
    runs; None: every op). Ops outside ``ops`` stay on the reference and are never checked: a model is not refused
    for an op it does not run.

    ``"auto"`` picks, per op, the first installed candidate that compilepack admits here; a candidate it refuses
    (``refusal``: below its floor, or wrong on this GPU) is skipped, with one :class:`KernelSkippedWarning` naming
    every skipped one, why, and the fix. ``"reference"`` forces the pure-torch reference everywhere. A dict names
    op kinds (``{"attention": "torch_varlen"}``: every op of the kind) or single ops
    (``{"gated_delta_rule_varlen": "reference"}``, which wins over its kind's entry); the rest is auto. A library
    named explicitly that compilepack refuses raises :class:`KernelVersionError`, one error naming every refused
    op: an old or broken kernel is never used silently, and one asked for is never silently swapped for another.
    """
    if isinstance(backend, Backends):
        return backend
    if backend == REFERENCE:
        return Backends()
    used = tuple(OPS) if ops is None else tuple(dict.fromkeys(ops))
    asked = _asked(backend)
    chosen, refused, skipped = {}, [], []
    for op in used:
        if op in asked:
            chosen[op] = asked[op]
            refused += [r for r in [refusal(asked[op], op)] if r]
        else:
            chosen[op], passed_over = best_admitted(op)
            skipped += passed_over
    _raise_refused(refused)
    if skipped:  # one warning for all of them; Python's filters show it once per place patch() is called from
        warnings.warn(_skipped_message(skipped, chosen), KernelSkippedWarning, stacklevel=3)
    return Backends(chosen)


def _asked(backend: str | dict[str, str]) -> dict[str, str]:
    """``backend=``'s choices per op: kinds expanded to their ops, then single ops over them; each checked to be a
    candidate of the op and installed."""
    if backend == "auto":
        return {}
    if not isinstance(backend, dict):
        raise ValueError(
            f"backend={backend!r} is not understood: expected 'auto', 'reference', a dict such as "
            f"{{'attention': 'torch_varlen'}}, or a compilepack.ops.backends.Backends."
        )
    unknown = sorted(set(backend) - set(kinds()) - set(OPS))
    if unknown:
        raise ValueError(f"unknown keys in backend=: {unknown}; expected op kinds {list(kinds())} or ops "
                         f"{sorted(OPS)}.")
    asked = {op: name for key, name in backend.items() if key not in OPS for op in ops_of_kind(key)}
    asked |= {key: name for key, name in backend.items() if key in OPS}
    for op, name in asked.items():
        if name not in candidates(op):
            raise ValueError(f"backend for {op!r} must be one of {candidates(op)}, got {name!r}.")
        if not is_installed(name):
            raise ValueError(f"backend {name!r} for {op!r} is not installed; install it or use 'auto'.")
    return asked


def best_admitted(op: str, after: str | None = None) -> tuple[str, list[Refusal]]:
    """The first installed candidate for ``op`` (past ``after`` when given) that compilepack admits here, and the
    installed ones it refused on the way. The reference is always admitted."""
    names = candidates(op)
    start = 0 if after is None else names.index(after) + 1
    passed_over = []
    for name in names[start:]:
        if not is_installed(name):
            continue
        refused = refusal(name, op)
        if refused is None:
            return name, passed_over
        passed_over.append(refused)
    raise AssertionError(f"no admitted backend for {op!r}")  # unreachable: the reference is last


def _raise_refused(refused: list[Refusal]) -> None:
    if not refused:
        return
    described = _described(refused)
    instead = in_user_terms({r.op: best_admitted(r.op, after=r.backend)[0] for r in refused})
    libraries = "a kernel library" if len(described) == 1 else f"{len(described)} kernel libraries"
    raise KernelVersionError(
        f"compilepack refuses {libraries} asked for on this machine (CUDA): " + "; ".join(described)
        + f". Or run without {'it' if len(described) == 1 else 'them'}: compilepack.patch(model, backend={instead!r}). "
        "See docs/kernels.md."
    )


def _skipped_message(skipped: list[Refusal], chosen: dict[str, str]) -> str:
    parts = [f"{text} (runs {chosen[ops[0]]!r} instead)" for text, ops in _described(skipped, with_ops=True)]
    settle = in_user_terms({r.op: chosen[r.op] for r in skipped})
    return (
        "compilepack skipped kernel libraries it refuses on this machine (CUDA): " + "; ".join(parts)
        + f". To choose this explicitly (and silence this warning): compilepack.patch(model, backend={settle!r}). "
        "See docs/kernels.md."
    )


def _described(refusals: list[Refusal], with_ops: bool = False) -> list:
    """One text per library refused for the same reason, naming its ops as users name them (``'delta_rule'`` when
    it is refused for every op of that kind)."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in refusals:
        groups.setdefault((r.backend, r.why, r.fix), []).append(r.op)
    texts = []
    for (backend, why, fix), ops in groups.items():
        text = f"{backend} for {', '.join(map(repr, in_user_terms(dict.fromkeys(ops, backend))))}: {why}. Fix: {fix}"
        texts.append((text, ops) if with_ops else text)
    return texts


def in_user_terms(per_op: dict[str, str]) -> dict[str, str]:
    """``per_op`` (op -> backend) as ``patch(backend=...)`` is written: the ops of a kind that all take one backend
    become the kind (``{"delta_rule": "reference"}``), the others stay single ops."""
    whole = {kind for kind in kinds() if len({per_op.get(op) for op in ops_of_kind(kind)} - {None}) == 1
             and all(op in per_op for op in ops_of_kind(kind))}
    written = {}
    for op, backend in per_op.items():
        kind = _kernels(op).kind
        written[kind if kind in whole else op] = backend
    return written


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
