"""Check 4: a packed bf16 training step is as close to fp32 as the model's own bf16 run of each document alone."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..batch.keys import LABELS
from .batches import PackedBatch
from .reference import logits_alone, per_document, summed_token_loss
from .results import CheckResult, guarded, raise_unless

# bf16: packed error per document at most this multiple of the model's own bf16 error on each document alone
# (flash-attention's rule: a kernel's error may be twice the same-dtype PyTorch error against fp32)
BF16_BAR = 2.0


def check_bf16_close(
    model: torch.nn.Module,
    case: PackedBatch,
    *,
    reference: torch.nn.Module | None = None,
    how: str = "autocast",
    bar: float = BF16_BAR,
    packed: Callable[[dict], dict] = lambda batch: batch,
) -> CheckResult:
    """A packed bf16 training step: its logits' error against fp32 (each document alone, through ``reference``)
    is at most ``bar`` x the reference's own bf16 error on each document alone, and its gradients are finite.

    The error of a run is its worst document's mean |logit difference| (a max over single logits would measure
    a mixture-of-experts router instead, where one near-tie token flipping its expert in bf16 decides the
    figure whichever side computes it). ``how``: ``"autocast"`` (CPU bf16 autocast, fp32 weights) or ``"cast"``
    (copies of both models cast to bf16). A model that raises fails the check.
    """
    reference = reference if reference is not None else model
    return guarded(f"bf16 {how}", f"<= {bar:g}x own", lambda: _bf16_close(model, case, reference, how, bar, packed))


def assert_bf16_close(model, case, **options) -> CheckResult:
    """:func:`check_bf16_close`, raising ``AssertionError`` with the two errors when it fails."""
    return raise_unless(check_bf16_close(model, case, **options))


def _bf16_close(model, case: PackedBatch, reference, how: str, bar: float, packed) -> CheckResult:
    fp32 = logits_alone(reference, case.documents)
    autocast = how == "autocast"
    if how == "cast":
        low, low_reference = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(reference).to(torch.bfloat16)
    else:
        low, low_reference = model, reference
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        own_error = _error(logits_alone(low_reference, case.documents), fp32)
        batch = packed(case.batch)
        logits = low(**batch).logits
        loss = summed_token_loss(logits, batch[LABELS])
    params = [p for p in low.parameters() if p.requires_grad]
    grads = [g for g in torch.autograd.grad(loss, params, allow_unused=True) if g is not None]
    finite = bool(grads) and all(torch.isfinite(g).all() for g in grads)
    error = _error(per_document(logits.detach(), case.spans), fp32)
    passed = error <= bar * own_error and finite
    details = [] if finite else ["the bf16 backward gave no gradient or a non-finite one"]
    ratio = error / own_error if own_error else float("inf")
    figure = f"{error:.3g} vs own {own_error:.3g} ({ratio:.2f}x)"
    return CheckResult(f"bf16 {how}", passed, figure, f"<= {bar:g}x own", details,
                       {"error": error, "own_error": own_error, "finite_gradients": finite})


def _error(pieces: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max((piece.float() - ref).abs().mean().item() for piece, ref in zip(pieces, reference))
