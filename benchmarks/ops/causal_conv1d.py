"""Benchmark helper: stock transformers ``causal_conv1d_fn`` vs ``compilepack::causal_conv1d_varlen``.

Sizes of a small Qwen3.5 Gated DeltaNet layer: conv channels D = 2 * key_dim + value_dim ~ 1024, width 4,
one packed row (B = 1), silu activation, x channel-last as transformers passes it (the transpose of the
``[B, T, D]`` projection).
"""

from __future__ import annotations

import torch

from ._common import as_rows, doc_lengths_of, equal_lengths_case, seq_idx_of

NAME = "causal_conv1d"


def setup(
    T: int = 2048, n_docs: int = 16, device: str = "cpu", seed: int = 0, *, dim: int = 1024, width: int = 4,
    equal_lengths: bool = False,
):
    """``stock()`` runs transformers' torch fallback on the packed row (leaks across documents: the cost
    baseline); ``packed()`` runs the op on the same tokens, on causal-conv1d when on CUDA and installed."""
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    from compilepack.ops import backends
    from compilepack.ops.causal_conv1d import causal_conv1d_varlen

    generator = torch.Generator().manual_seed(seed)
    seq_idx = seq_idx_of(doc_lengths_of(T, n_docs, generator, equal_lengths), device)
    x = torch.randn(1, T, dim, generator=generator).transpose(1, 2).to(device).requires_grad_()
    weight = torch.randn(dim, width, generator=generator).mul_(width**-0.5).to(device).requires_grad_()
    bias = torch.randn(dim, generator=generator).mul_(0.1).to(device).requires_grad_()
    on_cuda_kernel = device.startswith("cuda") and backends.is_installed("causal_conv1d")
    backend = "causal_conv1d" if on_cuda_kernel else backends.REFERENCE

    def stock():
        return causal_conv1d_fn(x, weight, bias, activation="silu")

    def packed():
        return causal_conv1d_varlen(x, weight, bias, seq_idx, "silu", backend=backend)

    def batched():  # [n, dim, L]; the output compared with packed's as [1, dim, T]
        return causal_conv1d_fn(as_rows(x, n_docs, 2), weight, bias, activation="silu")

    case = {"stock": stock, "packed": packed, "inputs": [x, weight, bias],
            "batched_as_packed": lambda out: out.movedim(0, 1).flatten(1)[None]}
    return equal_lengths_case(case, batched, equal_lengths)
