"""Small helpers shared by the ops: boundary conversions that are safe inside a compiled graph, and the boundary
check every op body makes."""

from __future__ import annotations

import torch


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of every token, ``int32 [total]``, from ``cu_seqlens`` ``[N+1]``.

    Traced as one ``searchsorted`` (no host sync, no data-dependent shape). Zero-length documents (the
    fixed-shape collator's unused slots) take no tokens, so they never appear in the result.
    """
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # Search the whole tensor (size N+1 >= 2), not cu_seqlens[1:]: a size-1 slice for a one-document batch
    # would be specialised by the compiler and cost a recompile.
    return (torch.searchsorted(cu_seqlens, positions, right=True) - 1).to(torch.int32)


def host_boundaries(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as Python ints, for reference ops that loop over documents.

    Only called inside custom-op bodies, which the compiler treats as opaque: the conversion never
    becomes a graph break. On CPU it is free; a CUDA reference path pays one sync here.
    """
    return cu_seqlens.tolist()


# how to build each kind of boundary tensor right, for the error that refuses one
_BUILD = {
    "cu_seqlens": "build it as 0 followed by the running sum of the document lengths",
    "seq_idx": "number each row's documents in order (0, 0, 1, 1, 1, 2, ...), as the HF collator does",
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
