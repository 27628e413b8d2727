"""Kimi Linear specifics beyond tests/patches/test_families.py (which runs this family like every other):
the MLA value padding, stock behaviour without boundaries, and the KDA replacement's refusals.
"""

from __future__ import annotations

import pytest
import torch

from compilepack.batch.derived import PackedBoundaries, seq_idx_from_cu_seqlens
from compilepack.batch.keys import PACKED_BOUNDARIES
from compilepack.ops.backends import Backends
from compilepack.errors import BoundaryError
from compilepack.ops.attention import varlen_attention
from compilepack.patching import family_named
from tests.families import tiny_config
from tests.models import build_pair, hf_batch, logits_alone, max_diff_packed_vs_alone, random_docs

FAMILY = family_named("kimi_linear")


@pytest.fixture(scope="module")
def pair():
    return build_pair(FAMILY)


def test_tiny_config_has_every_layer_type_and_mla_head_dims():
    config = tiny_config(FAMILY)
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert set(config.mlp_layer_types) == {"dense", "sparse"}
    # the case the value padding exists for: MLA's q/k head dim differs from its value head dim
    assert config.qk_nope_head_dim + config.qk_rope_head_dim != config.v_head_dim


def test_padded_batch_without_boundaries_stays_stock(pair):
    """No boundary kwargs: every replacement hands the stock functions their stock arguments (the attention the
    unpadded values), so a right-padded batch with an attention mask gives stock's logits."""
    stock, patched = pair
    ids = torch.randint(1, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    with torch.no_grad():
        expected = stock(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = patched(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert (got - expected).abs().max().item() <= 1e-6


def test_packed_batch_with_a_document_longer_than_two_chunks(pair):
    stock, patched = pair
    docs = random_docs(256, [150, 3, 64], seed=4)
    batch = hf_batch(docs)
    with torch.no_grad():
        packed = patched(**batch).logits
    assert max_diff_packed_vs_alone(packed, logits_alone(stock, docs), batch["cu_seq_lens_q"]) <= 1e-4


def test_kda_replacement_refuses_a_recurrent_state_with_boundaries():
    from transformers.models.kimi_linear import modeling_kimi_linear

    (kda,) = [r for r in FAMILY.layers["KimiLinearDeltaAttention"] if r.global_name == "chunk_kimi_delta_attention"]
    replacement = kda.make(modeling_kimi_linear.chunk_kimi_delta_attention, Backends(), None)
    q, k, v = (torch.randn(1, 10, 2, 8) for _ in range(3))
    g, beta = -torch.rand(1, 10, 2, 8), torch.rand(1, 10, 2)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    # what the patched decoder hands its layers, beside the HF keys
    packed = {"cu_seq_lens_q": cu,
              PACKED_BOUNDARIES: PackedBoundaries(cu, cu, 6, seq_idx_from_cu_seqlens(cu, 10)[None])}
    with pytest.raises(BoundaryError, match="recurrent state"):
        replacement(q, k, v, g=g, beta=beta, output_final_state=True, **packed)
    out, state = replacement(q, k, v, g=g, beta=beta, **packed)
    assert out.shape == (1, 10, 2, 8) and state is None


def test_varlen_attention_takes_a_value_head_dim_unlike_the_query_head_dim():
    """MLA: ``compilepack::varlen_attention`` takes ``v [T, Hkv, Dv]`` with ``Dv != D`` (it pads internally)."""
    q, k = torch.randn(10, 2, 24), torch.randn(10, 2, 24)
    v = torch.randn(10, 2, 16)
    out = varlen_attention(q, k, v, torch.tensor([0, 4, 10], dtype=torch.int32), 6)
    assert out.shape == (10, 2, 16)
