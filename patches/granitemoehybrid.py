"""Granite 4.0 hybrid (GraniteMoeHybrid): Mamba2 mixers (causal conv1d + SSD chunk scan; packed batches take the
unfused path) between attention layers, with MoE or dense MLPs that mix no tokens.

The mixer is Bamba's line for line; the decoder passes its kwargs (the boundaries included) to every layer.
"""

import transformers

from compilepack.patching import ATTENTION, MAMBA2_MIXER, DocsRow, Family, Fixtures, TinyModel, register

_GRANITE = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=64, max_position_embeddings=2048,
)

register(Family(
    "granitemoehybrid", "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    decoder="GraniteMoeHybridModel",
    layers={"GraniteMoeHybridAttention": (ATTENTION,), "GraniteMoeHybridMambaLayer": MAMBA2_MIXER},
    fixtures=Fixtures(
        tiny={
            # RoPE (as some checkpoints use): positions must restart per document too
            "moe": TinyModel(lambda: transformers.GraniteMoeHybridConfig(
                **_GRANITE, intermediate_size=32, shared_intermediate_size=64, num_local_experts=4,
                num_experts_per_tok=2, position_embedding_type="rope",
            ), moe=True),
            # no positional embedding, dense MLP (num_local_experts=0), like granite-4.0-h-micro
            "dense": TinyModel(lambda: transformers.GraniteMoeHybridConfig(
                **_GRANITE, intermediate_size=128, shared_intermediate_size=128, num_local_experts=0,
            )),
        },
        bench=lambda: transformers.GraniteMoeHybridConfig(
            vocab_size=256, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            intermediate_size=128, shared_intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
            mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=128, max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (Mamba2 layers scan one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
