"""An op and its float64 oracle, run the same way in every op's tests, and the comparisons of the two they share."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tests.ops.properties import assert_close, max_error


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside, for code that makes many tiny kernel calls: on two threads each call may open a
    parallel region that waits for the other core, which costs up to 100x when another process keeps it busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

def output_and_grads(out: Tensor, inputs: Sequence[Tensor], grad: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``out`` detached, and the gradients of ``inputs`` for the output gradient ``grad``."""
    return out.detach(), list(torch.autograd.grad(out, inputs, grad))


def output_and_random_grads(out: Tensor, inputs: Sequence[Tensor], grad_seed: int = 1):
    """``out`` detached, the gradients of ``inputs`` for a random output gradient drawn from ``grad_seed``, and
    that output gradient."""
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=out.dtype)
    return (*output_and_grads(out, inputs, grad), grad)


def run_fp64(fn: Callable[..., Tensor], inputs: Sequence[Tensor], grad: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``fn(*inputs)`` on float64 copies of the inputs (an oracle's exact answer): its output and the inputs'
    gradients for the output gradient ``grad``."""
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    return output_and_grads(fn(*inputs64), inputs64, grad.double())


@dataclasses.dataclass(frozen=True)
class OpChecks:
    """The correctness checks every op's tests share, for one op.

    ``run(inputs, boundaries, **kwargs)`` returns the op's output, the inputs' gradients and the random output
    gradient used (:func:`output_and_random_grads`); ``oracle(inputs, boundaries, grad, **kwargs)`` the naive
    oracle's output and gradients in float64 for that output gradient (:func:`run_fp64`). ``names`` name the
    inputs in messages; ``tol`` is the tolerance of :func:`assert_close`.
    """

    run: Callable
    oracle: Callable
    names: Sequence[str]
    tol: float
    what: str = "output"

    def assert_all_close(self, out, grads, out_ref, grads_ref, tol: float | None = None) -> None:
        """The output and every gradient within ``tol`` (the op's tolerance by default) of the reference's."""
        tol = self.tol if tol is None else tol
        assert_close(out, out_ref, self.what, tol)
        for name, got, ref in zip(self.names, grads, grads_ref):
            assert_close(got, ref, f"d{name}", tol)

    def assert_equals_oracle(self, inputs, boundaries, **kwargs) -> None:
        """The op's output and gradients within the tolerance of the float64 oracle's."""
        out, grads, grad = self.run(inputs, boundaries, **kwargs)
        self.assert_all_close(out, grads, *self.oracle(inputs, boundaries, grad, **kwargs))

    def assert_tolerance_catches_dropped_boundaries(self, inputs, boundaries, one_document) -> None:
        """The control: the op run with ``one_document`` (the boundaries dropped) misses the oracle run with
        ``boundaries`` by far more than the tolerance."""
        out, _, grad = self.run(inputs, one_document)
        out_ref, _ = self.oracle(inputs, boundaries, grad)
        assert max_error(out, out_ref) > 100 * self.tol

    def assert_same_bits(self, inputs, boundaries, *others) -> None:
        """The same documents described by other ``boundaries`` (empty documents added, say) give the same
        output and gradients, bit for bit."""
        out, grads, _ = self.run(inputs, boundaries)
        for other in others:
            out_other, grads_other, _ = self.run(inputs, other)
            assert torch.equal(out_other, out)
            for got, ref in zip(grads_other, grads):
                assert torch.equal(got, ref)

    def assert_bfloat16_kept(self, inputs, boundaries, shape) -> None:
        """bfloat16 inputs give a bfloat16 output of ``shape`` and bfloat16 gradients."""
        out, grads, _ = self.run(inputs, boundaries)
        assert out.dtype == torch.bfloat16 and out.shape == shape
        assert [g.dtype for g in grads] == [torch.bfloat16] * len(inputs)

    def assert_autocast_computes_in_fp32(self, inputs, boundaries, **kwargs) -> None:
        """Under CPU bfloat16 autocast the op computes in fp32 (autocast is off in custom-op bodies): a float32
        output, and output and gradients within the tolerance of the oracle's."""
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, grads, grad = self.run(inputs, boundaries, **kwargs)
        assert out.dtype == torch.float32
        self.assert_all_close(out, grads, *self.oracle(inputs, boundaries, grad, **kwargs))
