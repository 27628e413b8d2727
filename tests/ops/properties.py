"""Checks every op's tests share: tolerances, exact document isolation, fp64 gradcheck."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tests.strategies import bounds_of


def assert_close(actual: Tensor, expected: Tensor, what: str, tol: float) -> None:
    """``|actual - expected| <= tol * max(1, max |expected|)``: an absolute bound scaled by the reference's size,
    since the chunked algorithms' fp32 error grows with the entries' magnitude, not with the token count."""
    bound = tol * max(1.0, expected.abs().max().item())
    err = (actual.to(expected.dtype) - expected).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def max_error(actual: Tensor, expected: Tensor) -> float:
    return (actual.to(expected.dtype) - expected).abs().max().item() / max(1.0, expected.abs().max().item())


def _slice(x: Tensor, dim: int, start: int, end: int) -> Tensor:
    return x.narrow(dim, start, end - start)


def assert_documents_isolated(
    run: Callable[[list[Tensor]], Tensor],
    inputs: list[Tensor],
    others: list[Tensor],
    token_dims: Sequence[int | None],
    out_token_dim: int,
    bounds: list[int],
    document: int,
) -> None:
    """Document ``document`` of a packed row depends on nothing else, not even by rounding.

    ``inputs`` and ``others`` are two draws of the op's inputs; ``token_dims[i]`` is the token dim of input ``i``
    (None for inputs without one, such as weights). With every other document's tokens taken from ``others``, the
    document's output must be bit-identical, and the gradient of a loss on its output alone must be exactly zero
    on every other document's tokens.
    """
    start, end = bounds[document], bounds[document + 1]
    mixed = []
    for x, y, dim in zip(inputs, others, token_dims):
        if dim is None:
            mixed.append(x.detach().clone())
            continue
        z = y.detach().clone()
        _slice(z, dim, start, end).copy_(_slice(x.detach(), dim, start, end))
        mixed.append(z)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    mixed = [x.requires_grad_(x.is_floating_point()) for x in mixed]
    out, out_mixed = run(leaves), run(mixed)
    mine, mine_mixed = _slice(out, out_token_dim, start, end), _slice(out_mixed, out_token_dim, start, end)
    assert torch.equal(mine, mine_mixed), (
        f"document {document} changed when the other documents did: max diff {(mine - mine_mixed).abs().max():.3g}"
    )
    weights = torch.randn(mine.shape, generator=torch.Generator().manual_seed(document), dtype=mine.dtype)
    differentiable = [(x, dim) for x, dim in zip(leaves, token_dims) if x.requires_grad and dim is not None]
    grads = torch.autograd.grad((mine * weights).sum(), [x for x, _ in differentiable], allow_unused=True)
    for i, ((x, dim), grad) in enumerate(zip(differentiable, grads)):
        if grad is None:
            continue
        outside = torch.cat([_slice(grad, dim, 0, start).flatten(), _slice(grad, dim, end, grad.shape[dim]).flatten()])
        assert outside.numel() == 0 or outside.abs().max().item() == 0.0, (
            f"input {i}: gradient from document {document} leaks into other documents: {outside.abs().max():.3g}"
        )


def gradcheck(run: Callable[..., Tensor], inputs: list[Tensor]) -> bool:
    """``torch.autograd.gradcheck`` in float64 over the floating-point inputs (the others held fixed)."""
    inputs = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in inputs]
    return torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=False)


def at_least_two_documents(lengths: list[int]) -> list[int]:
    """``lengths``, with a 7-token document appended to a single one (isolation needs a neighbour)."""
    return lengths if len(lengths) >= 2 else [*lengths, 7]


def assert_packing_isolated(
    run: Callable[[list[Tensor]], Tensor],
    make_inputs: Callable[[int], list[Tensor]],
    lengths: list[int],
    token_dims: Sequence[int | None],
    out_token_dim: int,
) -> None:
    """:func:`assert_documents_isolated` for the first, a middle and the last document of the packing
    ``lengths``; ``make_inputs(seed)`` draws the op's inputs (seeds 1 and 2)."""
    bounds = bounds_of(lengths)
    for document in {0, len(lengths) // 2, len(lengths) - 1}:
        assert_documents_isolated(run, make_inputs(1), make_inputs(2), token_dims, out_token_dim, bounds, document)
