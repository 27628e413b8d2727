"""Jamba: Mamba1 selective-scan layers and attention layers, each followed by a dense MLP or a sparse MoE
block (per token, so it mixes nothing).

The decoder hands its kwargs (the boundaries included) to every layer, but the Mamba layer calls its mixer
without them and the mixer calls ``mamba_selective_scan`` without them: both calls are threaded
(``boundary_calls``). Jamba's mixer never takes a fused path.
"""

import transformers

from compilepack.patching import ATTENTION, MAMBA1_MIXER, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "jamba", "transformers.models.jamba.modeling_jamba", decoder="JambaModel",
    layers={"JambaAttention": (ATTENTION,), "JambaMambaMixer": MAMBA1_MIXER},
    boundary_calls={"JambaMambaDecoderLayer": ("self.mamba",), "JambaMambaMixer": ("mamba_selective_scan",)},
    fixtures=Fixtures(
        tiny={
            # Mamba + MLP, Mamba + MoE, attention + MLP, Mamba + MoE
            "hybrid_moe": TinyModel(lambda: transformers.JambaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
                num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=2048,
            ), moe=True),
        },
        bench=lambda: transformers.JambaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
            num_experts=4, num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=2,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong in the Mamba layers (they scan one long sequence); "
                         "with the collator's boundary kwargs: silently wrong (they never reach the mixers; with the "
                         "default use_cache=True the attention leaks too)",
        ),
    ),
))
