"""Benchmark helper: stock transformers SDPA attention on a packed row vs ``compilepack::varlen_attention``.

Stock is what an unpatched Llama does with a packed row under ``attn_implementation="sdpa"``: it builds one
dense ``T x T`` block-diagonal causal mask from the restarting position_ids (``create_causal_mask``, once per
forward, so outside the timing here) and every layer calls ``sdpa_attention_forward`` with it. Packed runs each
document's causal attention with itself only. Sizes of a small Llama layer: 8 query heads, 4 key/value heads
(GQA), head dim 64, one packed row.
"""

from __future__ import annotations

import types

import torch

from ._common import cu_seqlens_of, doc_lengths_of, equal_lengths_case

NAME = "attention"


def stock_packed_mask(lengths: list[int], heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The mask stock Llama (sdpa) builds for a packed row: transformers' own create_causal_mask."""
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    config._attn_implementation = "sdpa"
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    embeds = torch.empty(1, position_ids.shape[1], config.hidden_size)
    return create_causal_mask(config, embeds, attention_mask=None, cache=None, position_ids=position_ids)


def setup(
    T: int = 2048, n_docs: int = 16, device: str = "cpu", seed: int = 0, *, heads: int = 8, kv_heads: int = 4,
    head_dim: int = 64, equal_lengths: bool = False,
) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from compilepack.ops.attention import varlen_attention

    generator = torch.Generator().manual_seed(seed)
    lengths = doc_lengths_of(T, n_docs, generator, equal_lengths)
    cu_seqlens = cu_seqlens_of(lengths, device)
    mask = stock_packed_mask(lengths, heads, kv_heads, head_dim).to(device)
    # [T, heads, head_dim]: the tokens-first layout of the packed op; stock sees the [1, heads, T, head_dim] view
    q = torch.randn(T, heads, head_dim, generator=generator).to(device).requires_grad_()
    k = torch.randn(T, kv_heads, head_dim, generator=generator).to(device).requires_grad_()
    v = torch.randn(T, kv_heads, head_dim, generator=generator).to(device).requires_grad_()
    layer = types.SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads, training=True)
    backend = "torch_varlen" if device.startswith("cuda") else "reference"

    def stock():
        heads_first = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        return sdpa_attention_forward(layer, *heads_first, mask, scaling=head_dim**-0.5)[0]

    def packed():
        return varlen_attention(q, k, v, cu_seqlens, max(lengths), backend=backend)

    def batched():  # the documents as a [n, heads, L, head_dim] batch: plain causal sdpa, no mask
        rows = [x.unflatten(0, (n_docs, -1)).transpose(1, 2) for x in (q, k, v)]
        return sdpa_attention_forward(layer, *rows, None, scaling=head_dim**-0.5)[0]

    case = {"stock": stock, "packed": packed, "inputs": [q, k, v]}
    return equal_lengths_case(case, batched, equal_lengths)
