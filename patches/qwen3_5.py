"""Qwen3.5: Gated DeltaNet + gated attention, as a text model and inside the multimodal model (text batches).

Its position_ids may have several rows (multimodal RoPE): document boundaries come only from the boundary
kwargs, never from positions.
"""

import transformers

from compilepack.patching import ATTENTION, GATED_DELTANET, Checkpoint, DocsRow, Family, Fixtures, TinyModel, register

_QWEN3_5_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=2048,
)

_QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

register(Family(
    "qwen3_5", "transformers.models.qwen3_5.modeling_qwen3_5", decoder="Qwen3_5TextModel",
    model_types=("qwen3_5", "qwen3_5_text"), entries=("Qwen3_5Model",),
    layers={"Qwen3_5Attention": (ATTENTION,), "Qwen3_5GatedDeltaNet": GATED_DELTANET},
    fixtures=Fixtures(
        tiny={
            "text": TinyModel(lambda: transformers.Qwen3_5TextConfig(**_QWEN3_5_TEXT)),
            "multimodal": TinyModel(
                lambda: transformers.Qwen3_5Config(text_config=_QWEN3_5_TEXT, vision_config=_QWEN3_5_VISION),
                model_class="Qwen3_5ForConditionalGeneration",
            ),
        },
        bench=lambda: transformers.Qwen3_5TextConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            max_position_embeddings=4096,
        ),
        # Qwen/Qwen3.5-0.8B (text_config of config.json): the smallest Qwen3.5 release; tied embeddings, gated attention
        checkpoint=Checkpoint("Qwen/Qwen3.5-0.8B", lambda: transformers.Qwen3_5TextConfig(
            vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-6,
            tie_word_embeddings=True, max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        )),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (linear layers see one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
