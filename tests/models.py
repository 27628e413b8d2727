"""Tiny models and packed batches for the model-level tests."""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening

import compilepack
from compilepack.patching import Family
from tests.families import build_tiny

HF_COLLATOR = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)


def build_pair(family: Family, variant: str | None = None, seed: int = 0):
    """(stock, patched) tiny fp32 models with identical weights, in eval mode."""
    torch.manual_seed(seed)
    stock = build_tiny(family, variant).eval()
    patched = compilepack.patch(copy.deepcopy(stock))
    return stock, patched


def random_docs(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


def hf_batch(docs: list[list[int]]) -> dict:
    return HF_COLLATOR([{"input_ids": d} for d in docs])


def varied_length_batches(vocab_size: int, count: int = 10, seed: int = 0, max_len: int = 150) -> list[dict]:
    """HF-collated batches with different total lengths and document counts (1 to 6 documents)."""
    generator = random.Random(seed)
    batches = []
    for i in range(count):
        lengths = [generator.randint(1, max_len) for _ in range(generator.randint(1, 6))]
        batches.append(hf_batch(random_docs(vocab_size, lengths, seed=seed + i)))
    return batches


def logits_alone(model, docs: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs]


def max_diff_packed_vs_alone(packed_logits: torch.Tensor, alone: list[torch.Tensor], cu_seqlens) -> float:
    """Largest |logit difference| between each packed document and the same document run alone."""
    cu = cu_seqlens.tolist()
    flat = packed_logits.reshape(-1, packed_logits.shape[-1])
    return max((flat[s:e] - a).abs().max().item() for s, e, a in zip(cu[:-1], cu[1:], alone))


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross-entropy summed over target tokens (labels shifted by one, -100 ignored)."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shifted.reshape(-1), reduction="sum",
                           ignore_index=-100)


def relative_grad_error(grads: dict, reference: dict) -> float:
    """max |g - ref| over all parameters, relative to the largest reference gradient entry."""
    scale = max(r.abs().max().item() for r in reference.values())
    return max((grads[name] - reference[name]).abs().max().item() for name in reference) / scale
