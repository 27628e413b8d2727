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

from compilepack import testing
from tests.families import available_families, variants
from tests.models import build_pair, random_docs

LENGTHS = [70, 1, 23, 5, 40]
CASES = [pytest.param(f, v, id=f"{f.name}-{v}") for f in available_families() for v in variants(f)]


@pytest.mark.parametrize("how", ["autocast", "cast"])
@pytest.mark.parametrize("family, variant", CASES)
def test_bf16_packed_training_step(family, variant, how):
    """A packed bf16 training step (eval mode, as the stock reference: a training-mode MoE router may add noise;
    gradients flow all the same): finite gradients, packed error <= 2x stock's own bf16 error."""
    stock, patched = build_pair(family, variant)
    case = testing.packed_batch(random_docs(stock.config.get_text_config().vocab_size, LENGTHS))
    result = testing.assert_bf16_close(patched, case, reference=stock, how=how)
    assert result.values["finite_gradients"] and result.values["error"] <= 2 * result.values["own_error"]


@pytest.mark.parametrize("family, variant", CASES)
def test_documents_are_isolated_to_the_bit(family, variant):
    """Document B (the middle one) of a packed row: its logits are bit-identical when documents A and C get other
    embeddings, and a loss on B's logits alone gives A's and C's input embeddings a gradient of exactly 0.0."""
    _, patched = build_pair(family, variant)
    case = testing.packed_batch(random_docs(patched.config.get_text_config().vocab_size, [40, 70, 23]))
    result = testing.assert_documents_isolated(patched, case, document=1)
    assert result.values == {"logits_moved": 0.0, "gradient_across": 0.0}
