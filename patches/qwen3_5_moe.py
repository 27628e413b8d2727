"""Qwen3.5-MoE: Gated DeltaNet + gated attention with sparse-MoE MLPs, as a text model and inside the multimodal
model (text batches).

The token mixers are Qwen3.5's line for line; the MoE blocks mix no tokens across positions and stay stock. Its
position_ids may have several rows (multimodal RoPE): document boundaries come only from the boundary kwargs.
"""

import transformers

from compilepack.patching import ATTENTION, GATED_DELTANET, DocsRow, Family, Fixtures, TinyModel, register

_QWEN3_5_MOE_TEXT = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=2048,
)

_QWEN3_5_MOE_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

register(Family(
    "qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", decoder="Qwen3_5MoeTextModel",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"), entries=("Qwen3_5MoeModel",),
    layers={"Qwen3_5MoeAttention": (ATTENTION,), "Qwen3_5MoeGatedDeltaNet": GATED_DELTANET},
    fixtures=Fixtures(
        tiny={
            "text": TinyModel(lambda: transformers.Qwen3_5MoeTextConfig(**_QWEN3_5_MOE_TEXT), moe=True),
            "multimodal": TinyModel(
                lambda: transformers.Qwen3_5MoeConfig(text_config=_QWEN3_5_MOE_TEXT, vision_config=_QWEN3_5_MOE_VISION),
                model_class="Qwen3_5MoeForConditionalGeneration", moe=True,
            ),
        },
        bench=lambda: transformers.Qwen3_5MoeTextConfig(
            vocab_size=256, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
            linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (linear layers see one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
