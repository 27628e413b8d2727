"""Hypothesis strategies for packings: lists of document lengths that exercise every boundary case.

The edge cases every op must survive are drawn on purpose, not hoped for: 1-token documents, documents
longer than a chunk, documents that cross chunk edges, a single document, and many (64) documents.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

CHUNK = 64  # the chunk size of the chunked mixers (gated delta rule, Mamba2 SSD) in the tests


@st.composite
def doc_lengths(draw, max_docs: int = 64, max_len: int = 3 * CHUNK, max_total: int = 640) -> list[int]:
    """A packing as document lengths; total tokens <= max_total."""
    kind = draw(st.sampled_from(["mixed", "ones", "long", "chunk_edges", "single", "many"]))
    if kind == "ones":
        lengths = [1] * draw(st.integers(1, min(max_docs, 20)))
    elif kind == "long":
        lengths = draw(st.lists(st.integers(CHUNK + 1, max_len), min_size=1, max_size=3))
    elif kind == "chunk_edges":
        # lengths that put document starts just before, on, and just after chunk edges
        lengths = draw(st.lists(st.sampled_from([CHUNK - 1, CHUNK, CHUNK + 1, 1, 2, 3]), min_size=2, max_size=8))
    elif kind == "single":
        lengths = [draw(st.integers(1, max_len))]
    elif kind == "many":
        lengths = draw(st.lists(st.integers(1, 9), min_size=max_docs, max_size=max_docs))
    else:
        lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_docs))
    total, kept = 0, []
    for length in lengths:
        if total + length > max_total:
            break
        kept.append(length)
        total += length
    return kept or [1]


def cu_seqlens_of(lengths: list[int], device="cpu") -> torch.Tensor:
    """``int32 [N+1]`` cumulative lengths, as the HF collator emits them."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def seq_idx_of(lengths: list[int], device="cpu") -> torch.Tensor:
    """``int32 [1, T]`` document index per token, as the HF collator emits it."""
    ids = [i for i, length in enumerate(lengths) for _ in range(length)]
    return torch.tensor([ids], dtype=torch.int32, device=device)


def split_docs(x: torch.Tensor, lengths: list[int], dim: int) -> list[torch.Tensor]:
    """Cut a packed tensor into per-document pieces along ``dim``."""
    return list(torch.split(x, lengths, dim=dim))


def bounds_of(lengths: list[int]) -> list[int]:
    """Document boundaries as Python ints: ``[0, l0, l0 + l1, ...]``."""
    return cu_seqlens_of(lengths).tolist()
