"""Nemotron-H: a stack of single-mixer blocks, Mamba2 (causal conv1d + SSD chunk scan; packed batches take the unfused
path), attention (no positional embedding), MLP or MoE.

Only the Mamba2 and attention blocks mix tokens; the decoder hands them its kwargs (the boundaries included).
"""

import transformers

from compilepack.patching import ATTENTION, MAMBA2_MIXER, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "nemotron_h", "transformers.models.nemotron_h.modeling_nemotron_h", decoder="NemotronHModel",
    layers={"NemotronHAttention": (ATTENTION,), "NemotronHMamba2Mixer": MAMBA2_MIXER},
    fixtures=Fixtures(
        tiny={
            # one block of each type: Mamba2, MoE, attention, MLP ("ME*-")
            "moe": TinyModel(lambda: transformers.NemotronHConfig(
                vocab_size=256, hidden_size=64, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2,
                chunk_size=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=32, max_position_embeddings=2048,
            ), moe=True),
        },
        bench=lambda: transformers.NemotronHConfig(
            vocab_size=256, hidden_size=256,
            layers_block_type=["linear_attention", "mlp", "linear_attention", "mlp", "full_attention", "mlp"],
            num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=1536,
            mamba_num_heads=8, mamba_head_dim=64, n_groups=1, ssm_state_size=64, conv_kernel=4, expand=2,
            chunk_size=128, max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (Mamba2 blocks scan one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
