"""Check 3: one graph, no break, one compile over a stream of packed batches."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .explain import count_compiles, explain
from .results import CHECK_NAMES, CheckResult, first_line, guarded, raise_unless

THRESHOLD = "1 graph, 0 breaks, 1 compile"


def check_compiles_once(
    model: torch.nn.Module,
    batches: Sequence[Mapping],
    *,
    backward: bool = True,
    backend: str = "eager",
    packed: Callable[[dict], dict] = lambda batch: batch,
) -> CheckResult:
    """``torch.compile(fullgraph=True, dynamic=True)`` over ``batches``: one graph and no break for the forward
    (and, with ``backward``, forward+backward) of the first batch (``torch._dynamo.explain``'s counts), and one
    compile over the whole stream. ``backend``: ``"eager"`` (dynamo only: fast), ``"aot_eager"`` (also traces
    the custom ops' fakes and the backward graphs), or ``"inductor"`` (what training uses; slow on CPU). A model
    that raises fails the check."""
    return guarded(CHECK_NAMES["compile"], THRESHOLD,
                   lambda: _compiles_once(model, [packed(batch) for batch in batches], backward, backend))


def assert_compiles_once(model, batches, **options) -> CheckResult:
    """:func:`check_compiles_once`, raising ``AssertionError`` with the break and recompile reasons."""
    return raise_unless(check_compiles_once(model, batches, **options))


def _compiles_once(model, batches: list[dict], backward: bool, backend: str) -> CheckResult:
    details, values = [], {}
    reports = {"forward": _explained(model, batches[0], False)}
    if backward:
        reports["forward+backward"] = _explained(model, batches[0], True)
    for name, report in reports.items():
        values[name] = {"graphs": report.graphs, "breaks": report.graph_breaks}
        details += [f"{name} break: {reason}" for reason in report.break_reasons]
    clean = all(report.ok for report in reports.values())
    try:
        compiles = count_compiles(model, batches, dynamic=True, fullgraph=clean, backend=backend)
        values["compiles"] = compiles.compiles
        reasons = compiles.recompile_reasons
        details += [f"recompile: {reason}" for reason in reasons[:3]]
        details += [f"... and {len(reasons) - 3} more guard failures"] if len(reasons) > 3 else []
        compiled_once = compiles.compiles == 1
        stream = f"{compiles.compiles} compile(s) over {compiles.batches} batches"
    except Exception as error:  # fullgraph=True refused the model: say why
        compiled_once, stream = False, f"compile failed: {type(error).__name__}"
        details.append(f"torch.compile(fullgraph=True, dynamic=True): {first_line(error)}")
    figure = "; ".join(f"{name} {r.graphs} graph(s) {r.graph_breaks} break(s)" for name, r in reports.items())
    return CheckResult(CHECK_NAMES["compile"], clean and compiled_once, f"{figure}; {stream}", THRESHOLD, details,
                       values)


def _explained(model, batch, backward: bool):
    training = model.training
    model.train(backward)
    try:
        return explain(model, batch, backward=backward)
    finally:
        model.train(training)
