"""Qwen3-Next: Gated DeltaNet layers (causal conv1d + gated delta rule) between gated full-attention layers.

The MoE blocks mix no tokens across positions and stay stock.
"""

import transformers

from compilepack.patching import ATTENTION, GATED_DELTANET, Checkpoint, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next", decoder="Qwen3NextModel",
    layers={"Qwen3NextAttention": (ATTENTION,), "Qwen3NextGatedDeltaNet": GATED_DELTANET},
    fixtures=Fixtures(
        tiny={
            "moe": TinyModel(lambda: transformers.Qwen3NextConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                max_position_embeddings=2048,
            ), moe=True),
        },
        bench=lambda: transformers.Qwen3NextConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
            # dense MLPs: the MoE block is stock in both models and adds 10-15 s to every cold compile, which
            # the bench's 10-minute budget cannot spare (the tiny test configs keep the experts)
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
            mlp_only_layers=[0, 1], layer_types=["linear_attention", "full_attention"],
            max_position_embeddings=4096,
        ),
        # Qwen/Qwen3-Next-80B-A3B-Instruct (config.json; also transformers' Qwen3NextConfig docstring checkpoint), the
        # only Qwen3-Next release. Its 512 experts (10 routed + 1 shared of 512 per token) are replaced by a dense MLP
        # of the config's own intermediate_size 5120 (mlp_only_layers): about the active expert width per token
        # (5632), without the 1.6 B expert parameters per layer that cannot be held on the bench machine; the MoE is
        # stock code in both models.
        checkpoint=Checkpoint("Qwen/Qwen3-Next-80B-A3B-Instruct", lambda: transformers.Qwen3NextConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=2,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, mlp_only_layers=[0, 1],
            layer_types=["linear_attention", "full_attention"],
            rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        )),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (linear layers see one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
