"""Qwen3.5: Gated DeltaNet + gated attention, as a text model and inside the multimodal model (text batches).

Its position_ids may have several rows (multimodal RoPE): document boundaries come only from the boundary
kwargs, never from positions.
"""

from transformers import Qwen3_5Config, Qwen3_5TextConfig

from compilepack.patching import ATTENTION, Family, GATED_DELTANET, register

_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=2048,
)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

register(
    Family(
        name="qwen3_5",
        model_types=("qwen3_5", "qwen3_5_text"),
        modeling="transformers.models.qwen3_5.modeling_qwen3_5",
        decoder="Qwen3_5TextModel",
        entries=("Qwen3_5Model",),
        layers={
            "Qwen3_5Attention": (ATTENTION,),
            "Qwen3_5GatedDeltaNet": GATED_DELTANET,
        },
        tiny_configs={
            "text": lambda: Qwen3_5TextConfig(**_TEXT),
            "multimodal": lambda: Qwen3_5Config(text_config=_TEXT, vision_config=_VISION),
        },
        tiny_builders={"multimodal": "Qwen3_5ForConditionalGeneration"},
        bench_config=lambda: Qwen3_5TextConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            max_position_embeddings=4096,
        ),
        kernels="conv: causal-conv1d; delta rule: fla chunk_gated_delta_rule; attention: flash-attn / torch varlen",
        stock_packed=(
            "position_ids only: silently wrong (linear layers see one long sequence); with the collator's "
            "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)"
        ),
    )
)
