"""Qwen3.5-MoE: Gated DeltaNet + gated attention with sparse-MoE MLPs, as a text model and inside the multimodal
model (text batches).

The token mixers are Qwen3.5's line for line; the MoE blocks mix no tokens across positions and stay stock. Its
position_ids may have several rows (multimodal RoPE): document boundaries come only from the boundary kwargs.
"""

from compilepack.patching import ATTENTION, GATED_DELTANET, Family, register

register(Family(
    "qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", decoder="Qwen3_5MoeTextModel",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"), entries=("Qwen3_5MoeModel",),
    layers={"Qwen3_5MoeAttention": (ATTENTION,), "Qwen3_5MoeGatedDeltaNet": GATED_DELTANET},
))
