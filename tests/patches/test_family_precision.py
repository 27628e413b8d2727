"""Every registered family, with every tiny variant, the way TRL trains by default (bf16) and to the bit:

- bf16: a packed training step runs under CPU bf16 autocast and with the model cast to bf16, and its packed logits
  are within 2x the stock model's own bf16-vs-fp32 error on the same tokens (the flash-attention rule: a kernel's
  error may be at most twice the same-dtype PyTorch error against an fp32 reference). The error of a model is its
  worst document's mean |logit difference|: a max over single logits would measure MoE routing instead, where one
  near-tie token flipping its expert in bf16 (seen: 1 token of 139, 0.017 against 0.003 elsewhere) decides the
  figure whichever side computes it;
- isolation: a document's logits do not change, in any bit, when another document in the row changes, and a loss
  on one document sends exactly zero gradient into the other documents' inputs.
"""

from __future__ import annotations

import pytest
import torch

from tests.families import available_families, variants
from tests.models import build_pair, hf_batch, logits_alone, random_docs, summed_token_loss

LENGTHS = [70, 1, 23, 5, 40]
CASES = [pytest.param(f, v, id=f"{f.name}-{v}") for f in available_families() for v in variants(f)]


def _error(pieces: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The worst document's mean |logit difference| against the fp32 reference."""
    return max((piece.float() - ref).abs().mean().item() for piece, ref in zip(pieces, reference))


def _packed_vs_alone(packed: torch.Tensor, alone: list[torch.Tensor], cu_seqlens) -> float:
    cu = cu_seqlens.tolist()
    flat = packed.reshape(-1, packed.shape[-1])
    return _error([flat[s:e] for s, e in zip(cu[:-1], cu[1:])], alone)


def _alone_error(stock_low, reference: list[torch.Tensor], docs, autocast: bool) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return _error(logits_alone(stock_low, docs), reference)


@pytest.mark.parametrize("how", ["autocast", "cast"])
@pytest.mark.parametrize("family, variant", CASES)
def test_bf16_packed_training_step(family, variant, how):
    stock, patched = build_pair(family, variant)
    docs = random_docs(stock.config.get_text_config().vocab_size, LENGTHS)
    batch = hf_batch(docs)
    reference = logits_alone(stock, docs)  # fp32, each document alone
    if how == "cast":
        stock, patched = stock.to(torch.bfloat16), patched.to(torch.bfloat16)
    stock_error = _alone_error(stock, reference, docs, autocast=how == "autocast")
    # eval mode, as the stock reference: a training-mode MoE router may add noise; gradients flow all the same
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
        logits = patched(**batch).logits
        loss = summed_token_loss(logits, batch["labels"])
    loss.backward()
    grads = [p.grad for p in patched.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    error = _packed_vs_alone(logits.detach(), reference, batch["cu_seq_lens_q"])
    assert error <= 2 * stock_error, f"bf16 ({how}): packed error {error:.3g} > 2x stock's own {stock_error:.3g}"


@pytest.mark.parametrize("family, variant", CASES)
def test_documents_are_isolated_to_the_bit(family, variant):
    """Document B (the middle one) of a packed row: its logits are bit-identical when documents A and C get other
    embeddings, and a loss on B's logits alone gives A's and C's input embeddings a gradient of exactly 0.0."""
    _, patched = build_pair(family, variant)
    vocab = patched.config.get_text_config().vocab_size
    docs = random_docs(vocab, [40, 70, 23])
    batch = hf_batch(docs)
    start, end = batch["cu_seq_lens_q"][1:3].tolist()
    embed = patched.get_input_embeddings()
    with torch.no_grad():
        embeds = embed(batch["input_ids"])
        others = embeds.clone()
        others[:, :start] = torch.randn_like(others[:, :start])
        others[:, end:] = torch.randn_like(others[:, end:])
    packed = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
    embeds.requires_grad_(True)
    logits = patched(inputs_embeds=embeds, **packed).logits
    with torch.no_grad():
        logits_others = patched(inputs_embeds=others, **packed).logits
    mine, mine_others = logits[:, start:end], logits_others[:, start:end]
    assert torch.equal(mine, mine_others), f"B's logits moved by {(mine - mine_others).abs().max():.3g}"
    (grad,) = torch.autograd.grad(mine.float().square().sum(), embeds)
    outside = torch.cat([grad[:, :start], grad[:, end:]], dim=1)
    assert outside.abs().max().item() == 0.0, f"gradient into other documents: {outside.abs().max():.3g}"
    assert grad[:, start:end].abs().max() > 0
