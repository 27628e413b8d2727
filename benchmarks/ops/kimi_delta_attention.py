"""Benchmark helper: stock transformers ``chunk_kimi_delta_attention`` (its torch fallback) vs
``compilepack::kimi_delta_attention_varlen``.

Sizes of one small Kimi-Linear-style KDA layer: 4 heads of dim 64 (hidden 256; Kimi Linear has as many value
heads as q/k heads), one packed row (B = 1); g made as Kimi's forget gate makes it (``-exp(A_log) *
softplus(x + dt_bias)`` with fla's initialisation ranges: a per-channel log decay <= 0), sigmoid beta. The stock
function runs on the packed row without boundaries (wrong, but the cost baseline). It is slow on CPU (seconds
per call at T = 2048: a Python loop over chunk rows, under autograd): time it with few repeats.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from ._common import cu_seqlens_of, delta_rule_case, doc_lengths_of

NAME = "kimi_delta_attention"


def kimi_gate(T: int, heads: int, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    """``[1, T, heads, head_dim]`` log decays as ``KimiLinearForgetGate`` computes them at initialisation."""
    A_log = torch.empty(heads, 1).uniform_(1.0, 16.0, generator=generator).log()
    dt = torch.empty(heads * head_dim).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).view(heads, head_dim)  # inverse softplus, as fla initialises
    projection = torch.randn(1, T, heads, head_dim, generator=generator)
    return -A_log.exp() * F.softplus(projection + dt_bias)


def setup(
    T: int = 2048, n_docs: int = 16, device: str = "cpu", seed: int = 0, *, heads: int = 4, head_dim: int = 64,
    equal_lengths: bool = False,
) -> dict:
    from transformers.models.kimi_linear import modeling_kimi_linear

    from compilepack.ops.kimi_delta_attention import kimi_delta_attention_varlen

    # the torch fallback itself: the hub-kernel wrapper around it only adds a warning and a kwargs filter
    stock_kda = inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)
    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = cu_seqlens_of(doc_lengths_of(T, n_docs, generator, equal_lengths), device)
    q, k, v = (torch.randn(1, T, heads, head_dim, generator=generator) for _ in range(3))
    g = kimi_gate(T, heads, head_dim, generator)
    beta = torch.randn(1, T, heads, generator=generator).sigmoid()
    inputs = [x.to(device).requires_grad_() for x in (q, k, v, g, beta)]
    return delta_rule_case(stock_kda, kimi_delta_attention_varlen, inputs, cu_seqlens, device,
                           n_docs if equal_lengths else None)
