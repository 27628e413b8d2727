"""LFM2-MoE: LFM2's gated short-convolution and attention layers, with sparse-MoE feed-forwards after the first
dense layers.

The token mixers are LFM2's line for line; the MoE blocks mix no tokens across positions and stay stock.
"""

import transformers

from compilepack.patching import ATTENTION, CAUSAL_CONV1D, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "lfm2_moe", "transformers.models.lfm2_moe.modeling_lfm2_moe", decoder="Lfm2MoeModel",
    layers={"Lfm2MoeAttention": (ATTENTION,), "Lfm2MoeShortConv": (CAUSAL_CONV1D,)},
    fixtures=Fixtures(
        tiny={
            # layer 0 dense, layers 1-2 MoE (4 experts, top 2)
            "moe": TinyModel(lambda: transformers.Lfm2MoeConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_dense_layers=1, num_experts=4, num_experts_per_tok=2, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
                layer_types=["conv", "full_attention", "conv"], max_position_embeddings=2048,
            ), moe=True),
        },
        bench=lambda: transformers.Lfm2MoeConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_dense_layers=1, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, conv_L_cache=3,
            layer_types=["conv", "conv", "full_attention", "conv"], max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (short convs reach across document starts); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
