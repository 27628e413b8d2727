"""The rules a packed batch's boundaries must satisfy, their messages, and the two places they are checked.

One rule, one message: :func:`compilepack.validate` (host, once per batch), the patched decoder (every call) and
the integrations all raise the texts built here. Every message names the key, what was expected, what was found
and the fix.

The patched decoder checks every batch it receives, whoever built it:

- :func:`check_static` (types, dtypes, ranks, devices, conflicting inputs): facts dynamo knows while tracing. In
  eager they raise :class:`~compilepack.BoundaryError`; under ``torch.compile`` the refusal is raised from a
  function dynamo runs at trace time (``assume_constant_result``), so the message leads the compile error instead of
  hiding in an "Observed exception", and a valid batch adds nothing to the graph.
- :func:`check_values_on_host` when the boundaries are host tensors in eager mode (the common case): exact checks
  with the offending values in the message, on the host, before any compute.
- :func:`assert_values_in_graph` otherwise (compiled, or boundaries already on an accelerator): asynchronous
  device asserts (``torch._assert_async``). No ``.item()``, no ``.tolist()``, no branch on values, so no host sync
  and no graph break; a broken rule fails the step with a ``RuntimeError`` naming the rule (on CUDA at the next
  synchronising call).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch._dynamo.exc import UserError, UserErrorType

from .keys import (
    ATTENTION_MASK,
    BOUNDARY_KEYS,
    CACHE_KEYS,
    CU_SEQLENS,
    CU_SEQLENS_K,
    CU_SEQLENS_Q,
    FIX_COLLATE,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_KEYS,
    MAX_LENGTH_Q,
    POSITION_IDS,
    SEQ_IDX,
)
from .derived import document_starts
from ..errors import BoundaryError

_INTEGER_DTYPES = (torch.int32, torch.int64)


class Rule(NamedTuple):
    """One rule of the boundary contract: the key it is about, what is expected, and how to fix a violation.

    A NamedTuple, not a frozen dataclass: dynamo hands it to ``_refuse_if`` (``assume_constant_result``) as a
    constant, which torch 2.11's dynamo cannot do for a frozen dataclass."""

    key: str
    expected: str
    fix: str

    def message(self, found: str) -> str:
        return f"'{self.key}': expected {self.expected}, found {found}. Fix: {self.fix}."

    def refuse(self, found: str) -> BoundaryError:
        return BoundaryError(self.message(found))

    def assert_async(self, holds: torch.Tensor) -> None:
        """Fail the step (without a host sync) where ``holds`` is False."""
        torch._assert_async(holds, self.message("a value that breaks this rule (checked on the device)"))


_CUMULATIVE = "cumulative document lengths over the flattened tokens"
CU_TENSOR = Rule(
    CU_SEQLENS_Q, f"a 1-D int32 (or int64) tensor [N+1] of {_CUMULATIVE}",
    "build it as torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32); for several rows, the "
    "boundaries are still one 1-D tensor over all rows' tokens",
)
CU_DEVICE = Rule(
    CU_SEQLENS_Q, "a tensor on the CPU (the collator's host copy) or on the model's device",
    "leave it on the CPU (compilepack.to_device moves a batch but keeps the boundaries on the host)",
)
STARTS_AT_ZERO = Rule(
    CU_SEQLENS_Q, "0 as the first entry", "start the cumulative sum at 0; tokens before it would be dropped"
)
ENDS_AT_TOKENS = Rule(
    CU_SEQLENS_Q, "the batch's token count (rows x row length) as the last entry",
    "these boundaries belong to another batch, or were cut: build them from this batch's documents. If the tokens "
    "were sliced across ranks (accelerate's or transformers' cp_size / sp_size slice the tokens, not the "
    "boundaries), use compilepack's context parallelism instead: compilepack.integrations.context_parallel, or "
    "compilepack.patch(model, context_parallel=group) with compilepack.distributed.shard_batch "
    "(docs/context-parallel.md)",
)
NON_DECREASING = Rule(CU_SEQLENS_Q, "non-decreasing entries", "build it as a cumulative sum of document lengths")
ROW_EDGES = Rule(
    CU_SEQLENS_Q, "every row edge (a multiple of the row length) among the entries, as documents never cross rows",
    "end the last document of each row at the row's end (pad it), or pack all documents in one row",
)
K_EQUALS_Q = Rule(
    CU_SEQLENS_K, f"the same values as '{CU_SEQLENS_Q}' (in training every document attends to itself)",
    f"pass the same values for both, or leave '{CU_SEQLENS_K}' out",
)
CU_REQUIRED = Rule(
    CU_SEQLENS_Q, "present whenever a batch carries boundary kwargs (seq_idx alone cannot become boundaries "
    "inside a compiled graph)", FIX_COLLATE + " (return_flash_attn_kwargs=True)",
)
MAX_LENGTH = Rule(
    MAX_LENGTH_Q, "a Python int >= the longest document (an upper bound: the row length works)",
    "use the longest document's length, or leave it out (the row length is used)",
)
SEQ_IDX_TENSOR = Rule(
    SEQ_IDX, "an int32 (or int64) tensor shaped like input_ids [rows, row length]",
    f"build it with the boundaries, or leave it out (compilepack derives it from '{CU_SEQLENS_Q}')",
)
SEQ_IDX_AGREES = Rule(
    SEQ_IDX, f"document starts at the same tokens as '{CU_SEQLENS_Q}'",
    "build both from the same document lengths, or leave 'seq_idx' out",
)
NO_MASK = Rule(
    ATTENTION_MASK, "no padding mask in a batch with boundary kwargs (a mask conflicts with the packed layout)",
    "drop 'attention_mask' from packed batches: the boundaries already say which tokens belong together",
)
NO_CACHE = Rule(
    CACHE_KEYS[1], "no cache with a packed batch (a packed row holds several documents and cannot continue "
    "one cache)", "run packed batches without 'cache'/'past_key_values'; generate on unpacked inputs",
)
UNMARKED_PACKING = Rule(
    POSITION_IDS, "positions counting up without restart inside a row when the batch carries no boundary kwargs "
    "(compilepack never infers documents from position_ids: the row would run as one sequence, mixing documents)",
    FIX_COLLATE + ", or wrap the collator with compilepack.integrations.with_boundaries",
)
# Checked by compilepack.validate / checked / PackedCollator on the host; the model itself does not read labels, and
# positions only feed the rotary embedding.
POSITIONS_RESTART = Rule(
    POSITION_IDS, "positions counting from the same start inside every document (restarting at each one)",
    "build position_ids with the boundaries (DataCollatorWithFlattening does), or leave them out",
)
LABELS_AT_STARTS = Rule(
    LABELS, "-100 at every document start (the causal-LM loss shifts labels by one, so that label would be "
    "predicted from the previous document's last token)",
    "set labels to -100 at every document start, as DataCollatorWithFlattening does",
)
SHAPED_LIKE_TOKENS = Rule(
    LABELS, f"the shape of {INPUT_IDS}", f"build it with the same rows and row length as {INPUT_IDS}"
)


# ------------------------------------------------------------------------------------------------ static facts


@torch.compiler.assume_constant_result
def _refuse_if(broken: bool, rule: Rule, *found, key: str | None = None) -> bool:
    """Raise ``rule``'s error when ``broken`` (about ``key``, a twin of the rule's key, when given); ``found``:
    constants describing the value (see :func:`_facts`). ``rule`` is always a module-level one: dynamo treats those
    as constants on every admitted torch, while a rule built during tracing it cannot (torch 2.11).

    Under torch.compile dynamo calls this at trace time with its constant arguments instead of tracing it: the
    refusal surfaces as the compile error's first line, and a valid batch adds no node to the graph."""
    if broken:
        rule = rule if key is None else _about(key, rule)
        raise _as_raised(BoundaryError, rule.message(_described(*found)))
    return False


def check_static(kwargs: Mapping, tokens: torch.Tensor, row_length=None) -> None:
    """The rules that types, dtypes, ranks, devices and present keys decide (known while tracing). ``row_length``:
    the whole rows' length when ``tokens`` hold a context-parallel shard of each row (default: the tokens')."""
    _refuse_if(kwargs.get(CU_SEQLENS_Q) is None, CU_REQUIRED, f"no '{CU_SEQLENS_Q}'")
    _refuse_if(kwargs.get(ATTENTION_MASK) is not None, NO_MASK, "an 'attention_mask'")
    _refuse_if(has_cache(kwargs), NO_CACHE, "a cache")
    for key in (CU_SEQLENS_Q, CU_SEQLENS_K):
        _check_cu_static(key, kwargs.get(key), tokens.device)
    for key in MAX_LENGTH_KEYS:
        value = kwargs.get(key)
        bad_type = value is not None and (isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)))
        bad_tensor = isinstance(value, torch.Tensor) and (value.dim() != 0 or value.is_floating_point())
        _refuse_if(bad_type or bad_tensor, MAX_LENGTH, *_facts(value), key=key)
    seq_idx = kwargs.get(SEQ_IDX)
    if seq_idx is not None:
        bad = not isinstance(seq_idx, torch.Tensor) or seq_idx.dtype not in _INTEGER_DTYPES or seq_idx.dim() != 2
        rows = (tokens.shape[0], tokens.shape[1] if row_length is None else row_length)
        _refuse_if(_decided(bad or tuple(seq_idx.shape) != rows), SEQ_IDX_TENSOR, *_facts(seq_idx))


def _check_cu_static(key: str, cu, device: torch.device) -> None:
    if cu is None:
        return
    bad = not isinstance(cu, torch.Tensor) or cu.dtype not in _INTEGER_DTYPES or cu.dim() != 1 or cu.shape[0] < 2
    _refuse_if(_decided(bad), CU_TENSOR, *_facts(cu), key=key)
    _refuse_if(cu.device.type != "cpu" and cu.device != device, CU_DEVICE, *_facts(cu), key=key)


@torch.compiler.assume_constant_result
def refuse(error_type: type[Exception], message: str) -> bool:
    """Raise ``error_type(message)``, in eager and while dynamo traces a compiled model alike, so that a user's
    ``except BoundaryError`` (or ``ContextParallelError``...) catches a compiled model's refusal too.

    For the refusals a patched forward makes from static facts (what a batch holds, types, shapes). Dynamo calls
    this at trace time with its constant arguments (the message is built from constants) instead of tracing a
    ``raise``, which ``fullgraph=True`` would turn into an "Observed exception"."""
    raise _as_raised(error_type, message)


def _as_raised(error_type: type[Exception], message: str) -> Exception:
    """``error_type(message)``; while dynamo traces, an instance of a subclass that is also dynamo's ``UserError``,
    the kind of exception dynamo re-raises as it is: any other it rewraps as ``InternalTorchDynamoError`` with no
    cause, which an ``except BoundaryError`` misses."""
    if not torch.compiler.is_compiling():
        return error_type(message)
    return _raised_while_tracing(error_type)(message)


@functools.cache
def _raised_while_tracing(error_type: type[Exception]) -> type[Exception]:
    def __init__(self, message: str) -> None:
        UserError.__init__(self, UserErrorType.INVALID_INPUT, message)

    # the same name, so the compile error reads as the eager one ("BoundaryError: 'cu_seq_lens_q': expected ...")
    namespace = {"__init__": __init__, "__module__": error_type.__module__}
    return type(error_type.__name__, (error_type, UserError), namespace)


def _decided(condition) -> bool:
    """``condition`` as a plain bool. A comparison of symbolic sizes is a SymBool while compiling; branching on it
    makes dynamo decide it (a guard on the sizes), so the refusal's argument is a constant."""
    return True if condition else False


def _facts(value) -> tuple:
    """What a message says about a value, as constants dynamo can hand to :func:`_refuse_if`: the type's name,
    and for a tensor its dtype, device and shape (only its rank while compiling: sizes may be symbolic)."""
    if not isinstance(value, torch.Tensor):
        return (type(value).__name__,)
    shape = value.dim() if torch.compiler.is_compiling() else tuple(value.shape)
    return ("Tensor", value.dtype, str(value.device), shape)


def _described(*found) -> str:
    if len(found) == 1:
        return found[0] if found[0].startswith(("a ", "an ", "no ")) else f"a {found[0]}"
    _, dtype, device, shape = found
    shape = f"{shape}-D" if isinstance(shape, int) else f"shape {list(shape)}"
    return f"a tensor of {str(dtype).replace('torch.', '')}, {shape}, on {device}"


# ------------------------------------------------------------------------------------------------ values, on the host


def check_values_on_host(kwargs: Mapping, rows: int, row_length: int) -> list[int]:
    """Every value rule, exactly, on host boundaries; returns ``cu_seq_lens_q`` as Python ints.

    Raises :class:`~compilepack.BoundaryError` with the offending entries in the message.
    """
    cu = check_cumulative_on_host(CU_SEQLENS_Q, kwargs[CU_SEQLENS_Q], rows * row_length)
    cu_k = kwargs.get(CU_SEQLENS_K)
    if cu_k is not None and cu_k is not kwargs[CU_SEQLENS_Q] and cu_k.tolist() != cu:
        raise K_EQUALS_Q.refuse(f"{_preview(cu_k.tolist())} next to '{CU_SEQLENS_Q}' {_preview(cu)}")
    check_row_edges_on_host(cu, rows, row_length)
    longest = max(e - s for s, e in zip(cu[:-1], cu[1:]))
    for key in MAX_LENGTH_KEYS:
        value = kwargs.get(key)
        if value is not None and int(value) < longest:
            raise _about(key, MAX_LENGTH).refuse(f"{int(value)} with a document of {longest} tokens")
    seq_idx = kwargs.get(SEQ_IDX)
    if seq_idx is not None and seq_idx.device.type == "cpu":
        check_seq_idx_on_host(seq_idx, cu, rows, row_length)
    return cu


def check_cumulative_on_host(key: str, cu: torch.Tensor, total: int) -> list[int]:
    """The rules of one cumulative-lengths tensor (already of the right type and rank), on the host."""
    values = cu.tolist()
    if values[0] != 0:
        raise _about(key, STARTS_AT_ZERO).refuse(f"{values[0]} in {_preview(values)}")
    drop = next((i for i in range(1, len(values)) if values[i] < values[i - 1]), None)
    if drop is not None:
        raise _about(key, NON_DECREASING).refuse(
            f"entry {drop} ({values[drop]}) < entry {drop - 1} ({values[drop - 1]})"
        )
    if values[-1] != total:
        raise _about(key, ENDS_AT_TOKENS).refuse(f"{values[-1]} for a batch of {total} tokens")
    return values


def check_row_edges_on_host(cu: list[int], rows: int, row_length: int) -> None:
    missing = sorted({r * row_length for r in range(1, rows)} - set(cu))
    if missing:
        crossing = next(i for i in range(len(cu) - 1) if cu[i] < missing[0] < cu[i + 1])
        raise ROW_EDGES.refuse(
            f"document {crossing} (tokens {cu[crossing]}:{cu[crossing + 1]}) crossing the row edge at token "
            f"{missing[0]} (rows of {row_length})"
        )


def check_seq_idx_on_host(seq_idx: torch.Tensor, cu: list[int], rows: int, row_length: int) -> None:
    """``seq_idx`` may number documents differently (the HF collator skips empty ones); what must agree is where
    a new document starts."""
    given = document_starts(seq_idx.to("cpu"))
    wanted = torch.zeros(rows * row_length, dtype=torch.bool)
    wanted[[s for s in cu[:-1] if s < rows * row_length]] = True
    wanted = wanted.view(rows, row_length)
    wanted[:, 0] = True
    if not torch.equal(given, wanted):
        row, column = (given != wanted).nonzero()[0].tolist()
        says = "starts" if bool(given[row, column]) else "does not start"
        raise SEQ_IDX_AGREES.refuse(
            f"a document that {says} at row {row}, token {column} in 'seq_idx' but "
            f"{'does not' if bool(given[row, column]) else 'does'} in '{CU_SEQLENS_Q}'"
        )


def _about(key: str, rule: Rule) -> Rule:
    """The same rule for a twin key (``cu_seq_lens_k`` for ``cu_seq_lens_q``, ``max_length_k`` for ``_q``)."""
    return rule if rule.key == key else rule._replace(key=key)


def _preview(values: list[int], limit: int = 8) -> str:
    return str(values) if len(values) <= limit else f"[{', '.join(map(str, values[:limit]))}, ...]"


# ------------------------------------------------------------------------------------------------ values, in the graph


def assert_values_in_graph(kwargs: Mapping, cu: torch.Tensor, seq_idx: torch.Tensor) -> None:
    """Every value rule as an asynchronous device assert on ``cu`` (``cu_seq_lens_q`` on the model's device);
    ``seq_idx``: ``[rows, row length]``, the document index of every token derived from ``cu`` (the decoder's own).

    Size-``N+1`` tensors only (never ``cu[1:]``, whose size 1 for a one-document batch would be specialised by
    the compiler and cost a recompile)."""
    rows, row_length = seq_idx.shape
    total = rows * row_length
    STARTS_AT_ZERO.assert_async(cu[0] == 0)
    ENDS_AT_TOKENS.assert_async(cu[-1] == total)
    NON_DECREASING.assert_async((cu == cu.cummax(0).values).all())  # equal to its running maximum: never drops
    edges = torch.arange(1, rows, device=cu.device, dtype=cu.dtype) * row_length
    ROW_EDGES.assert_async(torch.isin(edges, cu).all())
    lengths = torch.diff(cu, prepend=cu[:1])
    for key in MAX_LENGTH_KEYS:
        bound = kwargs.get(key)
        if bound is not None:
            bound = bound.to(cu.device) if isinstance(bound, torch.Tensor) else bound
            _about(key, MAX_LENGTH).assert_async((lengths <= bound).all())
    cu_k = kwargs.get(CU_SEQLENS_K)
    if cu_k is not None and cu_k is not kwargs[CU_SEQLENS_Q]:
        _refuse_if(_decided(cu_k.shape[0] != cu.shape[0]), K_EQUALS_Q, "a different number of entries")
        K_EQUALS_Q.assert_async((cu_k.to(cu.device, cu.dtype) == cu).all())
    if kwargs.get(SEQ_IDX) is not None:
        assert_seq_idx_in_graph(kwargs[SEQ_IDX], seq_idx)


def assert_seq_idx_in_graph(given: torch.Tensor, derived: torch.Tensor) -> None:
    """The batch's ``seq_idx`` starts a document exactly where the one derived from ``cu_seq_lens_q`` does, as an
    asynchronous assert on the derived one's device."""
    SEQ_IDX_AGREES.assert_async((document_starts(given.to(derived.device)) == document_starts(derived)).all())


def refuse_unmarked_packing(position_ids: torch.Tensor, *, read_on_host: bool = True) -> None:
    """Refuse ``[rows, T]`` position ids that restart inside a row of a batch without boundary kwargs: such a batch
    runs every row as one sequence, so a restart means the boundaries were dropped.

    ``read_on_host``: read the positions (copied to the host if need be) and raise :class:`BoundaryError`, as host
    validation and an eager forward on host positions do. Otherwise (inside a compiled graph, or positions on an
    accelerator, where reading them would be a host sync) an asynchronous device assert carrying the same rule.
    """
    if not read_on_host:
        restarts = document_starts(position_ids, step=1)[:, 1:]  # a row start is no restart
        UNMARKED_PACKING.assert_async(~restarts.any())
        return
    restarts = document_starts(position_ids.to("cpu"), step=1)
    restarts[:, 0] = False  # a row start is no restart
    if restarts.any():
        row, column = restarts.nonzero()[0].tolist()
        raise UNMARKED_PACKING.refuse(f"a restart at row {row}, token {column} and no boundary kwargs")


def has_cache(kwargs: Mapping) -> bool:
    """Whether a call carries a cache (under either name transformers has used): a static fact of the call."""
    return any(kwargs.get(key) is not None for key in CACHE_KEYS)


def has_boundaries(kwargs: Mapping) -> bool:
    """Whether a batch (or a forward's kwargs) carries any boundary kwarg: a static fact of the call."""
    return any(kwargs.get(key) is not None for key in BOUNDARY_KEYS)


# ------------------------------------------------------------------------------------------------ the ops' own check

# how to build each kind of boundary tensor right, for the error that refuses one
_BUILD = {
    CU_SEQLENS: "build it as 0 followed by the running sum of the document lengths",
    SEQ_IDX: "number each row's documents in order (0, 0, 1, 1, 1, 2, ...), as the HF collator does",
}


def refuse_steps_back(op: str, argument: str, boundaries: torch.Tensor | None) -> None:
    """Refuse boundaries that decrease: ``cu_seqlens`` ``[N+1]``, or ``seq_idx`` ``[b, T]`` along a row.

    Every path assumes they rise: a binary search over ``cu_seqlens``, documents of ``seq_idx`` told apart by
    equality (tokens sharing an index inside a convolution window or an SSD chunk are one document to mamba-ssm's
    kernels and to the references alike), so a decreasing entry silently mixes or drops documents' tokens. Called
    in op bodies, and only on host tensors, where reading them is free: on CUDA the patched model's guards check
    the host copies before the forward, and a direct call with CUDA boundaries is not checked (that would sync).
    """
    if boundaries is None or boundaries.device.type != "cpu" or boundaries.shape[-1] < 2:
        return
    steps_back = boundaries[..., 1:] < boundaries[..., :-1]
    if not bool(steps_back.any()):
        return
    *row, column = steps_back.nonzero()[0].tolist()
    at = f"row {row[0]}, " if row else ""
    before, after = boundaries[(*row, column)].item(), boundaries[(*row, column + 1)].item()
    raise ValueError(
        f"{op}: {argument} must not decrease, but goes from {before} to {after} at {at}index {column + 1}; "
        f"{_BUILD[argument.removesuffix('_cpu')]}. Decreasing boundaries would mix or drop documents' tokens."
    )
