"""The op contract every op's tests check alike: opcheck of the forward and backward ops, one graph without breaks,
one compile over varied packings, compiled gradients equal to eager's, and errors that say what is wrong."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import pytest
import torch
from torch import Tensor

from tests.compiling import graphs_compiled
from tests.ops.properties import assert_close


def opcheck_forward_and_backward(op, args, needs_grad, with_output=False, test_utils=None) -> list[Tensor]:
    """``torch.library.opcheck`` of ``op.forward`` on ``args``, then of ``op.backward`` on the forward's results
    (``out`` passed when the op saves it, ``with_output``); returns what the forward saved."""
    options = {} if test_utils is None else {"test_utils": test_utils}
    torch.library.opcheck(op.forward, args, **options)
    # the backward op has no double backward: check it on plain tensors
    plain = [x.detach() if isinstance(x, Tensor) else x for x in args]
    out, saved = op.forward(*plain)
    backward_args = (torch.randn_like(out), out if with_output else None, saved, needs_grad, *plain)
    torch.library.opcheck(op.backward, backward_args, **options)
    return saved


def assert_one_graph(loss_of: Callable, grads_of: Callable, args: Sequence) -> None:
    """``loss_of`` and ``grads_of`` (its gradients by ``torch.autograd.grad``) each trace to one graph, no break."""
    forward = torch._dynamo.explain(loss_of)(*args)
    assert (forward.graph_count, forward.graph_break_count) == (1, 0), forward.break_reasons
    # autograd.grad inside the traced function needs this flag (off by default: it is a graph break otherwise)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        both = torch._dynamo.explain(grads_of)(*args)
    assert (both.graph_count, both.graph_break_count) == (1, 0), both.break_reasons


def assert_compiles_once(
    loss_of: Callable, calls: Iterable[Sequence], backward: bool = False, equals_eager: bool = False
) -> None:
    """``loss_of`` compiled once (``fullgraph``, dynamic shapes, aot_eager) serves every argument tuple of
    ``calls``, each with its backward when ``backward``, each loss equal to eager's bit for bit if
    ``equals_eager``."""
    compiled = torch.compile(loss_of, fullgraph=True, dynamic=True, backend="aot_eager")
    with graphs_compiled() as compiles:
        for args in calls:
            loss = compiled(*args)
            if backward:
                loss.backward()
            if equals_eager:
                assert torch.equal(loss, loss_of(*args))
        assert compiles() == 1


def assert_aot_eager_grads_equal_eager(loss_of: Callable, inputs: list[Tensor], others: Sequence, names) -> None:
    """The gradients of ``loss_of(*inputs, *others)`` compiled (aot_eager) within 1e-6 of eager's."""
    compiled = torch.compile(loss_of, fullgraph=True, dynamic=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(*inputs, *others), inputs)
    grads_eager = torch.autograd.grad(loss_of(*inputs, *others), inputs)
    for name, got, ref in zip(names, grads, grads_eager):
        assert_close(got, ref, f"d{name}", tol=1e-6)


def assert_refused(fn: Callable, args: dict, change: Callable[[dict], None], message: str) -> None:
    """``fn(**args)`` after ``change(args)`` raises a ValueError containing ``message`` (taken literally)."""
    change(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(**args)
