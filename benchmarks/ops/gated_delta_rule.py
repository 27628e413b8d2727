"""Benchmark helper: stock transformers ``torch_chunk_gated_delta_rule`` vs ``compilepack::gated_delta_rule_varlen``.

Sizes of one small Qwen3.5-style Gated DeltaNet layer: 4 q/k heads, 8 value heads (grouped), head dim 64
(value dim 512), one packed row (B = 1); g and beta made as the model makes them (log-sigmoid-like decay <= 0,
sigmoid beta). The stock function runs on the packed row without boundaries (wrong, but the cost baseline).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import cu_seqlens_of, delta_rule_case, doc_lengths_of

NAME = "gated_delta_rule"


def setup(
    T: int = 2048, n_docs: int = 16, device: str = "cpu", seed: int = 0, *, num_k_heads: int = 4, num_v_heads: int = 8,
    head_dim: int = 64, equal_lengths: bool = False,
) -> dict:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from compilepack.ops.gated_delta_rule import gated_delta_rule_varlen

    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = cu_seqlens_of(doc_lengths_of(T, n_docs, generator, equal_lengths), device)
    q = torch.randn(1, T, num_k_heads, head_dim, generator=generator)
    k = torch.randn(1, T, num_k_heads, head_dim, generator=generator)
    v = torch.randn(1, T, num_v_heads, head_dim, generator=generator)
    g = F.logsigmoid(torch.randn(1, T, num_v_heads, generator=generator) + 2)
    beta = torch.randn(1, T, num_v_heads, generator=generator).sigmoid()
    inputs = [x.to(device).requires_grad_() for x in (q, k, v, g, beta)]
    return delta_rule_case(torch_chunk_gated_delta_rule, gated_delta_rule_varlen, inputs, cu_seqlens, device,
                           n_docs if equal_lengths else None)
