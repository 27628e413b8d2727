"""Qwen3-Next: Gated DeltaNet layers (causal conv1d + gated delta rule) between gated full-attention layers.

The MoE blocks mix no tokens across positions and stay stock.
"""

from compilepack.patching import ATTENTION, GATED_DELTANET, Family, register

register(Family(
    "qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next", decoder="Qwen3NextModel",
    layers={"Qwen3NextAttention": (ATTENTION,), "Qwen3NextGatedDeltaNet": GATED_DELTANET},
))
