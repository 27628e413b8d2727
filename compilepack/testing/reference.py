"""Each document alone: the reference every exactness check compares a packed run with, and the tolerances.

The reference is the model itself run on each document as a plain, unpacked batch (a patched model runs stock
code there), unless a check is given another ``reference`` model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError
from ..batch.keys import IGNORE_INDEX

# fp32 tolerances of packed vs each document alone, as compilepack's own tests use them: attention alone is exact
# up to summation order; chunked linear mixers (gated delta rule, SSD scans) add their chunked rounding.
ATTENTION_ONLY_TOLERANCE = 1e-5
HYBRID_TOLERANCE = 1e-4


def tolerance_for(model: torch.nn.Module) -> float:
    """The fp32 tolerance of packed vs alone for this model: 1e-5 when only attention mixes tokens, 1e-4 when a
    registered family has other mixers, and for a model compilepack does not know."""
    from ..patching import family_of

    try:
        family = family_of(model)
    except UnsupportedModelError:
        return HYBRID_TOLERANCE
    only_attention = all(
        r.global_name == "ALL_ATTENTION_FUNCTIONS" for needed in family.layers.values() for r in needed
    )
    return ATTENTION_ONLY_TOLERANCE if only_attention else HYBRID_TOLERANCE


def logits_alone(model: torch.nn.Module, documents: Sequence[Sequence[int]], device=None) -> list[torch.Tensor]:
    """fp32 logits ``[len(doc), vocab]`` of each document run alone, as a plain one-row batch on ``device``."""
    with torch.no_grad():
        return [model(input_ids=torch.tensor([doc], device=device), use_cache=False).logits[0].float()
                for doc in documents]


def per_document(logits: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """The packed logits ``[rows, T, vocab]`` cut into each document's, fp32."""
    flat = logits.reshape(-1, logits.shape[-1])
    return [flat[start:end].float() for start, end in spans]


def max_error(logits: torch.Tensor, spans: Sequence[tuple[int, int]], alone: Sequence[torch.Tensor]) -> float:
    """max |packed - alone| over every logit of every document."""
    return max((p - a).abs().max().item() for p, a in zip(per_document(logits, spans), alone))


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross-entropy summed over target tokens (labels shifted by one, -100 ignored): summed, so the
    packed loss is exactly the sum of the documents' losses."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shifted.reshape(-1), reduction="sum",
                           ignore_index=IGNORE_INDEX)
