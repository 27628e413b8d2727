"""Graph-break and recompile tooling: does this model compile to one graph, and stay compiled?"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import types
from collections.abc import Iterable, Mapping

import torch
import torch._dynamo
import torch._dynamo.guards
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
    recompile_reasons: list[str] = dataclasses.field(default_factory=list)  # the guard that failed, per recompile

    def __str__(self) -> str:
        text = f"{self.compiles} compile(s) over {self.batches} batches"
        return text + "".join(f"\n  recompile: {reason}" for reason in self.recompile_reasons)


def explain(model: torch.nn.Module, batch: Mapping, *, backward: bool = False, reset: bool = False) -> ExplainReport:
    """Graphs, breaks and break reasons of ``model(**batch)`` under dynamo (``torch._dynamo.explain``).

    With ``backward=True`` the traced function also runs ``loss.backward()`` (dynamo's
    ``trace_autograd_ops``), so a break anywhere in forward or backward shows up. Parameter gradients are left
    as they were.

    Counted with a capturing backend (``torch._dynamo.explain`` would reset dynamo, discarding every compiled
    function of the process). ``reset=True`` calls ``torch._dynamo.reset()`` before and after, for a count from a
    clean slate; off by default, as it discards the process's other compiled functions too.
    """
    _maybe_reset(reset)
    graphs: list[torch.fx.GraphModule] = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    # torch._dynamo.explain would do this too, but it resets dynamo unconditionally; a counting backend does not
    breaks_before = collections.Counter(torch._dynamo.utils.counters["graph_break"])
    with _autograd_traced(backward), _grads_preserved(model):
        torch.compile(_step(model, backward), backend=capture)(batch)
    breaks = collections.Counter(torch._dynamo.utils.counters["graph_break"]) - breaks_before
    _maybe_reset(reset)
    return ExplainReport(
        graphs=len(graphs),
        graph_breaks=sum(breaks.values()),
        break_reasons=[_first_line(reason) for reason in breaks],
        ops=sum(1 for g in graphs for node in g.graph.nodes if node.op in ("call_function", "call_method")),
    )


def count_compiles(
    model: torch.nn.Module,
    batches: Iterable[Mapping],
    *,
    dynamic: bool | None = True,
    backward: bool = False,
    fullgraph: bool = False,
    backend: str = "eager",
    reset: bool = False,
) -> CompileReport:
    """Compile ``model`` once and count dynamo compiles over ``batches`` (1 = no recompiles).

    Compiles with ``backend`` (default ``"eager"``: dynamo only, no codegen, so counting is fast; use
    ``"aot_eager"`` to trace the backward graphs too). Counts dynamo's compiled graphs: a restarted analysis
    (dynamo re-tracing one frame after specialising a float) is not a recompile and is not counted.

    ``reset=True`` calls ``torch._dynamo.reset()`` before and after (see :func:`explain`); off by default, as it
    discards the process's other compiled functions. Without it, code dynamo already compiled for this model's
    forward in this process (with the same guards) may be reused and not counted.
    """
    _maybe_reset(reset)
    step = _step(model, backward)
    compiled = torch.compile(step, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
    count = 0
    graphs_before = _compiled_graphs()
    with _autograd_traced(backward), _grads_preserved(model):
        for batch in batches:
            compiled(batch)
            count += 1
    compiles = _compiled_graphs() - graphs_before
    # dynamo records the failed guard of every recompile per code object; the step's code is fresh (see _step)
    reasons = [_without_compile_id(reason) for reason in torch._dynamo.guards.guard_failures.get(step.__code__, [])]
    _maybe_reset(reset)
    return CompileReport(batches=count, compiles=compiles, recompile_reasons=list(dict.fromkeys(reasons)))


def _maybe_reset(reset: bool) -> None:
    if reset:
        torch._dynamo.reset()


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

    step = forward_backward if backward else forward
    # a fresh code object per call: dynamo keeps compiled code per code object, so an earlier explain or count
    # (with other guards or backends) can neither be reused nor use up the recompile limit of this one
    return types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, None, step.__closure__)


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


def _without_compile_id(reason: str) -> str:
    """A guard failure's first line without dynamo's compile id ("28/0: "), so one cause is listed once."""
    return re.sub(r"^\d+/\d+: ", "", _first_line(reason))


def _first_line(reason: str) -> str:
    lines = str(reason).strip().splitlines()
    return lines[0] if lines else ""
