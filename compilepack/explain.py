"""Graph-break and recompile tooling: does this model compile to one graph, and stay compiled?"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Mapping

import torch
import torch._dynamo
import torch._dynamo.utils


@dataclasses.dataclass
class ExplainReport:
    """What ``torch._dynamo.explain`` saw for one call."""

    graphs: int
    graph_breaks: int
    break_reasons: list[str]
    ops: int

    @property
    def ok(self) -> bool:
        return self.graphs == 1 and self.graph_breaks == 0

    def __str__(self) -> str:
        text = f"{self.graphs} graph(s), {self.graph_breaks} break(s), {self.ops} op(s)"
        return text + "".join(f"\n  break: {reason}" for reason in self.break_reasons)


@dataclasses.dataclass
class CompileReport:
    """How often a compiled model compiled over a stream of batches."""

    batches: int
    compiles: int  # graphs dynamo compiled over the stream: 1 means one graph and no recompiles

    def __str__(self) -> str:
        return f"{self.compiles} compile(s) over {self.batches} batches"


def explain(model: torch.nn.Module, batch: Mapping, *, backward: bool = False) -> ExplainReport:
    """Graphs, breaks and break reasons of ``model(**batch)`` under dynamo (``torch._dynamo.explain``).

    With ``backward=True`` the traced function also runs ``loss.backward()`` (dynamo's
    ``trace_autograd_ops``), so a break anywhere in forward or backward shows up. Parameter gradients are left
    as they were.
    """
    torch._dynamo.reset()
    with _autograd_traced(backward), _grads_preserved(model):
        result = torch._dynamo.explain(_step(model, backward))(batch)
    torch._dynamo.reset()
    return ExplainReport(
        graphs=result.graph_count,
        graph_breaks=result.graph_break_count,
        break_reasons=[_reason(r) for r in result.break_reasons],
        ops=result.op_count,
    )


def count_compiles(
    model: torch.nn.Module,
    batches: Iterable[Mapping],
    *,
    dynamic: bool | None = True,
    backward: bool = False,
    fullgraph: bool = False,
    backend: str = "eager",
) -> CompileReport:
    """Compile ``model`` once and count dynamo compiles over ``batches`` (1 = no recompiles).

    Compiles with ``backend`` (default ``"eager"``: dynamo only, no codegen, so counting is fast; use
    ``"aot_eager"`` to trace the backward graphs too). Counts dynamo's compiled graphs: a restarted analysis
    (dynamo re-tracing one frame after specialising a float) is not a recompile and is not counted.
    """
    torch._dynamo.reset()
    compiled = torch.compile(_step(model, backward), backend=backend, dynamic=dynamic, fullgraph=fullgraph)
    count = 0
    graphs_before = _compiled_graphs()
    with _autograd_traced(backward), _grads_preserved(model):
        for batch in batches:
            compiled(batch)
            count += 1
    compiles = _compiled_graphs() - graphs_before
    torch._dynamo.reset()
    return CompileReport(batches=count, compiles=compiles)


def _compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _step(model, backward: bool):
    def forward(batch):
        return model(**batch).logits

    def forward_backward(batch):
        output = model(**batch)
        loss = output.loss if output.loss is not None else output.logits.float().square().mean()
        loss.backward()
        return loss.detach()  # returning the live loss would make dynamo break ("consumed grad_fn")

    return forward_backward if backward else forward


@contextlib.contextmanager
def _autograd_traced(enabled: bool):
    # trace_autograd_ops lets dynamo put loss.backward() in the graph instead of breaking on it.
    with torch._dynamo.config.patch(trace_autograd_ops=enabled) if enabled else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _grads_preserved(model: torch.nn.Module):
    saved = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        for parameter, grad in saved:
            parameter.grad = grad


def _reason(break_reason) -> str:
    text = str(getattr(break_reason, "reason", break_reason)).strip()
    first = text.splitlines()[0] if text else ""
    frames = getattr(break_reason, "user_stack", None) or []
    where = f" (at {frames[-1].filename.split('/')[-1]}:{frames[-1].lineno})" if frames else ""
    return first + where
