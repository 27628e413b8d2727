"""The model FLOPs of a training step and the machine's matmul throughput: a mode's utilisation (MFU) is the
first per second over the second."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def step_flops(model: nn.Module, doc_lengths: list[int]) -> float:
    """Useful FLOPs of one training step on these documents' real tokens: every ``nn.Linear`` (2 per weight and
    token forward, 2 for the input gradient, 2 for the weight gradient when it trains) and causal softmax attention
    per document; the linear mixers' state math (GDN, SSD, conv) is not counted."""
    linear = sum(m.weight.numel() * (6 if m.weight.requires_grad else 4) for m in model.modules()
                 if isinstance(m, nn.Linear))
    return linear * sum(doc_lengths) + _attention_flops(model.config.get_text_config(), doc_lengths)


def _attention_flops(config, doc_lengths: list[int]) -> float:
    """Scores and values of causal attention, forward and backward: ``6 * L^2 * head_dim * heads`` per document
    and attention layer."""
    layer_types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if layer_types:
        layers = sum(1 for kind in layer_types if "attention" in kind and "linear" not in kind)
    elif getattr(config, "attn_layer_indices", None) is not None:
        layers = len(config.attn_layer_indices)
    else:
        layers = config.num_hidden_layers
    if not layers:
        return 0.0
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6.0 * layers * heads * head_dim * sum(length * length for length in doc_lengths)


def matmul_gflops(threads: int | None = None, size: int = 2048, repeats: int = 5) -> dict:
    """This machine's fp32 matmul throughput now: ``size``-cubed ``torch.mm``, best and median of ``repeats``."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # first call: allocation, thread pool
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            rates.append(2 * size**3 / (time.perf_counter() - start) / 1e9)
    finally:
        torch.set_num_threads(saved)
    return {"gflops_best": round(max(rates), 1), "gflops_median": round(statistics.median(rates), 1),
            "shape": f"{size}x{size} @ {size}x{size} fp32", "threads": threads or saved}
