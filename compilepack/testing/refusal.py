"""Check 5: malformed batches handed straight to the model never run silently: the model refuses each (raises) or
runs it exactly (each document's logits as if it ran alone)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..batch.keys import INPUT_IDS
from ..batch.validation import validate
from .batches import PackedBatch, malformed_batches, malformed_documents, packed_batch
from .reference import logits_alone, max_error, tolerance_for
from .results import CHECK_NAMES, CheckResult, describe_error, guarded, raise_unless

NAME = CHECK_NAMES["refusal"]
THRESHOLD = "each refused or exact"  # by the model; and the well-formed batch runs


def check_refuses_bad_batches(
    model: torch.nn.Module,
    batches: Mapping[str, dict] | None = None,
    *,
    documents: Sequence[Sequence[int]] | None = None,
    tolerance: float | None = None,
) -> CheckResult:
    """Every malformed batch (:func:`malformed_batches`), handed to the model directly, is refused by the model
    (it raises) or run exactly (its logits equal each document run alone within ``tolerance``, default
    :func:`tolerance_for`): none mixes documents silently. A well-formed batch of the same ``documents`` (default
    :func:`malformed_documents`, those every malformed batch holds) must run: a model that refuses everything
    proves nothing.

    Only the model decides. Labels across a document start break a rule of the data pipeline the model cannot
    see (it does not know which labels it should not train on): that batch passes when the model runs it
    exactly, as it should. ``compilepack.validate``, the host check ``PackedCollator`` and ``compilepack.checked``
    run on every batch, is run on each batch too and reported beside (``refused_by_host``); it does not depend on
    the model, so it decides nothing here.
    """
    return guarded(NAME, THRESHOLD, lambda: _refuses_bad_batches(model, batches, documents, tolerance))


def assert_refuses_bad_batches(model, batches=None, **options) -> CheckResult:
    """:func:`check_refuses_bad_batches`, raising ``AssertionError`` naming the batches that ran silently."""
    return raise_unless(check_refuses_bad_batches(model, batches, **options))


def _refuses_bad_batches(model, batches, documents, tolerance) -> CheckResult:
    vocab = model.config.get_text_config().vocab_size
    batches = batches if batches is not None else malformed_batches(vocab)
    good = packed_batch(documents if documents is not None else malformed_documents(vocab))
    _refuse_other_tokens(batches, good)
    tolerance = tolerance if tolerance is not None else tolerance_for(model)
    _, error = _run(model, good.batch)
    if error is not None:  # a model that refuses everything proves nothing
        return CheckResult(NAME, False, "the well-formed batch fails", THRESHOLD,
                           [f"a well-formed batch of the same documents fails: {describe_error(error, 160)}"],
                           {"tolerance": tolerance}, error)
    alone = logits_alone(model, good.documents)
    values = {"refused_by_model": [], "exact": [], "silent": [], "refused_by_host": [], "tolerance": tolerance}
    details = []
    for name, batch in batches.items():
        outcome, what = _measured(model, batch, good, alone, tolerance)
        values[outcome].append(name)
        host = _host_refusal(batch)
        values["refused_by_host"] += [name] if host else []
        details.append(f"{name}: {what}; compilepack.validate " + (f"refuses it: {host}" if host else "accepts it"))
    count = len(batches)
    ok = len(values["refused_by_model"]) + len(values["exact"])
    figure = (f"model {ok}/{count} refused or exact ({len(values['refused_by_model'])} refused, "
              f"{len(values['exact'])} exact); host check {len(values['refused_by_host'])}/{count} refused")
    details.sort(key=lambda line: "SILENTLY" not in line)
    return CheckResult(NAME, not values["silent"], figure, THRESHOLD, details, values)


def _measured(model, batch: dict, good: PackedBatch, alone: list[torch.Tensor], tolerance: float) -> tuple[str, str]:
    """(outcome: ``refused_by_model``, ``exact`` or ``silent``, what the model did)."""
    output, error = _run(model, batch)
    if error is not None:
        return "refused_by_model", f"refused by the model: {describe_error(error, 160)}"
    tokens = good.batch[INPUT_IDS].numel()
    if output.logits.shape[:-1].numel() != tokens:
        return "silent", f"RAN SILENTLY: {output.logits.shape[:-1].numel()} positions of logits for {tokens} tokens"
    error = max_error(output.logits, good.spans, alone)
    if error <= tolerance:
        return "exact", f"run exactly by the model (logits within {error:.1e} of each document alone)"
    return "silent", (f"RAN SILENTLY: the model mixed its documents (logits off by {error:.2e}, tolerance "
                      f"{tolerance:.0e})")


def _run(model, batch: dict):
    """(the model's output, None) or (None, the error it raised)."""
    try:
        with torch.no_grad():
            return model(**batch), None
    except Exception as error:  # noqa: BLE001 - any error is a refusal: the batch did not run silently
        return None, error


def _host_refusal(batch: dict) -> str:
    """``compilepack.validate``'s error for this batch, "" when it accepts it."""
    try:
        validate(batch)
    except Exception as error:  # noqa: BLE001 - the host check's refusal, reported beside the model's
        return describe_error(error, 160)
    return ""


def _refuse_other_tokens(batches: Mapping[str, dict], good: PackedBatch) -> None:
    """Each batch must hold the documents' tokens, or "exact" would compare it with other documents."""
    expected = good.batch[INPUT_IDS].flatten()
    for name, batch in batches.items():
        tokens = batch.get(INPUT_IDS)
        if tokens is not None and not torch.equal(torch.as_tensor(tokens).flatten(), expected):
            raise ValueError(f"the batch {name!r} does not hold the tokens of the documents it is compared with; "
                             "pass documents=[...], the token lists every batch holds, in order.")
