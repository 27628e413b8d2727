"""Qwen3.5: Gated DeltaNet + gated attention, as a text model and inside the multimodal model (text batches).

Its position_ids may have several rows (multimodal RoPE): document boundaries come only from the boundary
kwargs, never from positions.
"""

from compilepack.patching import ATTENTION, GATED_DELTANET, Family, register

register(Family(
    "qwen3_5", "transformers.models.qwen3_5.modeling_qwen3_5", decoder="Qwen3_5TextModel",
    model_types=("qwen3_5", "qwen3_5_text"), entries=("Qwen3_5Model",),
    layers={"Qwen3_5Attention": (ATTENTION,), "Qwen3_5GatedDeltaNet": GATED_DELTANET},
))
