"""Checks 1 and 2: packed == each document alone (logits and gradients, fp32), and documents isolated bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..batch.keys import INPUT_IDS, INPUTS_EMBEDS, LABELS
from .batches import PackedBatch, packed_batch
from .reference import logits_alone, max_error, summed_token_loss, tolerance_for
from .results import CHECK_NAMES, CheckResult, guarded, raise_unless

# the leak control: the same documents run as one document must miss the tolerance by at least this factor, or the
# tolerance could not tell a leak from rounding
CONTROL_FACTOR = 100


def _unchanged(batch: dict) -> dict:
    return batch


def as_list(batches: Sequence[PackedBatch] | PackedBatch) -> list[PackedBatch]:
    return [batches] if isinstance(batches, PackedBatch) else list(batches)


# ----------------------------------------------------------------------------------- 1. packed == each document alone


def check_packed_matches_unpacked(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch] | PackedBatch,
    *,
    reference: torch.nn.Module | None = None,
    tolerance: float | None = None,
    gradients: bool = True,
    control: bool = True,
    packed: Callable[[dict], dict] = _unchanged,
    **forward_kwargs,
) -> CheckResult:
    """Packed logits (and, with ``gradients``, parameter gradients of the summed token loss) equal the same
    documents run one by one through ``reference`` (default: ``model`` on plain unpacked batches).

    Logits: max |packed - alone| over every document of every batch. Gradients (first batch): max |packed - sum
    over documents| relative to the largest gradient entry. With ``control``, the first batch's documents run as
    one long document (boundaries dropped) must miss the tolerance by ``CONTROL_FACTOR``x. ``packed`` rewrites a
    batch before the model sees it (:func:`position_ids_only` to test a stock model's own packing);
    ``forward_kwargs`` go to the packed call (``use_cache=True``). A model that raises fails the check.
    """
    tolerance = tolerance if tolerance is not None else tolerance_for(model)
    threshold = f"<= {tolerance:.0e}" + (f" (control >= {CONTROL_FACTOR * tolerance:.0e})" if control else "")
    return guarded(CHECK_NAMES["packed"], threshold, lambda: _packed_matches_unpacked(
        model, as_list(batches), reference if reference is not None else model, tolerance, gradients, control,
        packed, threshold, forward_kwargs))


def assert_packed_matches_unpacked(model, batches, **options) -> CheckResult:
    """:func:`check_packed_matches_unpacked`, raising ``AssertionError`` with the figures when it fails."""
    return raise_unless(check_packed_matches_unpacked(model, batches, **options))


def _packed_matches_unpacked(model, batches, reference, tolerance, gradients, control, packed, threshold,
                             forward_kwargs) -> CheckResult:
    alone = {case.name: logits_alone(reference, case.documents) for case in batches}  # the reference, once
    errors, details = {}, []
    for case in batches:
        with torch.no_grad():
            logits = model(**packed(case.batch), **forward_kwargs).logits
        errors[case.name] = max_error(logits, case.spans, alone[case.name])
    logits_error = max(errors.values())
    worst = max(errors, key=errors.get)
    figures = {"logits": logits_error}
    if gradients:
        figures["gradients"] = _gradients_error(model, reference, batches[0], packed)
    if control:
        figures["control"] = _merged_error(model, alone[batches[0].name], batches[0], packed)
    passed = logits_error <= tolerance and figures.get("gradients", 0.0) <= tolerance
    if logits_error > tolerance:
        details.append(f"worst batch: {worst} ({_describe(batches, worst)}); per batch: "
                       + ", ".join(f"{name} {error:.2e}" for name, error in errors.items()))
    if control and figures["control"] < CONTROL_FACTOR * tolerance:
        passed = False
        details.append(f"the control cannot tell a leak from rounding: the documents run as one document miss by "
                       f"{figures['control']:.2e} only (needs >= {CONTROL_FACTOR * tolerance:.0e})")
    figure = ", ".join(f"{name} {value:.2e}" for name, value in figures.items())
    return CheckResult(CHECK_NAMES["packed"], passed, figure, threshold, details, {**figures, "tolerance": tolerance})


def _describe(batches: Sequence[PackedBatch], name: str) -> str:
    case = next(c for c in batches if c.name == name)
    rows = case.batch[INPUT_IDS].shape[0]
    return f"{len(case.documents)} documents of {[len(d) for d in case.documents]} tokens in {rows} row(s)"


def _merged_error(model, alone: list[torch.Tensor], case: PackedBatch, packed) -> float:
    merged = packed_batch([[token for doc in case.documents for token in doc]])
    with torch.no_grad():
        logits = model(**packed(merged.batch)).logits
    return max_error(logits, case.spans, alone)


def _gradients_error(model, reference, case: PackedBatch, packed) -> float:
    batch = packed(case.batch)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    packed_grads = torch.autograd.grad(summed_token_loss(model(**batch).logits, batch[LABELS]), params,
                                       allow_unused=True)
    ref_params = dict(reference.named_parameters())
    alone = {name: torch.zeros_like(ref_params[name]) for name in names}
    for doc in case.documents:
        single = packed_batch([doc]).batch
        loss = summed_token_loss(reference(input_ids=single[INPUT_IDS], use_cache=False).logits, single[LABELS])
        for name, grad in zip(names, torch.autograd.grad(loss, [ref_params[n] for n in names], allow_unused=True)):
            if grad is not None:
                alone[name] += grad
    scale = max(g.abs().max().item() for g in alone.values())
    return max(
        ((g if g is not None else torch.zeros_like(alone[n])) - alone[n]).abs().max().item()
        for n, g in zip(names, packed_grads)
    ) / scale


# --------------------------------------------------------------------------------------------------- 2. isolation


def check_documents_isolated(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch] | PackedBatch,
    *,
    document: int | None = None,
    packed: Callable[[dict], dict] = _unchanged,
) -> CheckResult:
    """One document of each multi-document batch (``document``, default the middle one) depends on nothing else:
    with every other document's input embeddings replaced by random ones, its logits are bit-identical, and a
    loss on its logits alone sends exactly 0.0 gradient into the other documents' embeddings. A model that raises
    fails the check."""
    return guarded(CHECK_NAMES["isolation"], "0 (bit for bit)",
                   lambda: _documents_isolated(model, as_list(batches), document, packed))


def assert_documents_isolated(model, batches, **options) -> CheckResult:
    """:func:`check_documents_isolated`, raising ``AssertionError`` with the figures when it fails."""
    return raise_unless(check_documents_isolated(model, batches, **options))


def _documents_isolated(model, batches, document, packed) -> CheckResult:
    changed, leaked, details, checked = 0.0, 0.0, [], 0
    for case in batches:
        if len(case.documents) < 2:
            continue
        index = document if document is not None else len(case.documents) // 2
        same, moved, grad_out, grad_in = _isolation(model, packed(case.batch), case.spans[index])
        if not same or grad_out or not grad_in:
            details.append(f"{case.name}, document {index}: logits moved by {moved:.3g}, gradient into other "
                           f"documents {grad_out:.3g}" + ("" if grad_in else ", and no gradient into itself"))
        changed, leaked, checked = max(changed, moved), max(leaked, grad_out), checked + 1
    if not checked:
        details.append("no batch holds two documents: nothing to isolate")
    figure = f"logits moved {changed:.3g}, gradient across {leaked:.3g}"
    return CheckResult(CHECK_NAMES["isolation"], not details, figure, "0 (bit for bit)", details,
                       {"logits_moved": changed, "gradient_across": leaked})


def _isolation(model, batch: dict, span: tuple[int, int]) -> tuple[bool, float, float, bool]:
    """(logits bit-identical, largest change, largest gradient into other documents, any gradient into itself)."""
    start, end = span
    embed = model.get_input_embeddings()
    rows = batch[INPUT_IDS].shape[0]
    with torch.no_grad():
        embeds = embed(batch[INPUT_IDS]).reshape(-1, embed.embedding_dim)
        others = embeds.clone()
        generator = torch.Generator().manual_seed(start)
        others[:start] = torch.randn(others[:start].shape, generator=generator, dtype=others.dtype)
        others[end:] = torch.randn(others[end:].shape, generator=generator, dtype=others.dtype)
    kwargs = {k: v for k, v in batch.items() if k not in (INPUT_IDS, LABELS)}
    embeds.requires_grad_(True)
    logits = model(**{INPUTS_EMBEDS: embeds.view(rows, -1, embeds.shape[-1])}, **kwargs).logits
    with torch.no_grad():
        logits_others = model(**{INPUTS_EMBEDS: others.view(rows, -1, others.shape[-1])}, **kwargs).logits
    mine = logits.reshape(-1, logits.shape[-1])[start:end]
    mine_others = logits_others.reshape(-1, logits.shape[-1])[start:end]
    same = torch.equal(mine, mine_others)
    moved = 0.0 if same else (mine.float() - mine_others.float()).abs().max().item()
    (grad,) = torch.autograd.grad(mine.float().square().sum(), embeds)
    outside = torch.cat([grad[:start], grad[end:]])
    grad_out = outside.abs().max().item() if outside.numel() else 0.0
    return same, moved, grad_out, bool(grad[start:end].abs().max() > 0)
