"""Qwen3-Next: Gated DeltaNet layers (causal conv1d + gated delta rule) between gated full-attention layers.

The MoE blocks mix no tokens across positions and stay stock.
"""

from transformers import Qwen3NextConfig

from compilepack.patching import ATTENTION, Family, GATED_DELTANET, register

register(
    Family(
        name="qwen3_next",
        modeling="transformers.models.qwen3_next.modeling_qwen3_next",
        decoder="Qwen3NextModel",
        layers={
            "Qwen3NextAttention": (ATTENTION,),
            "Qwen3NextGatedDeltaNet": GATED_DELTANET,
        },
        tiny_configs={
            "moe": lambda: Qwen3NextConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                max_position_embeddings=2048,
            ),
        },
        bench_config=lambda: Qwen3NextConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
            # dense MLPs: the MoE block is stock in both models and adds 10-15 s to every cold compile, which
            # the bench's 10-minute budget cannot spare (the tiny test configs keep the experts)
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
            mlp_only_layers=[0, 1], layer_types=["linear_attention", "full_attention"],
            max_position_embeddings=4096,
        ),
        kernels="conv: causal-conv1d; delta rule: fla chunk_gated_delta_rule; attention: flash-attn / torch varlen",
        stock_packed=(
            "position_ids only: silently wrong (linear layers see one long sequence); with the collator's "
            "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)"
        ),
    )
)
