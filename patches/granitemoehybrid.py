"""Granite 4.0 hybrid (GraniteMoeHybrid): Mamba2 mixers (causal conv1d + SSD chunk scan; packed batches take the
unfused path) between attention layers, with MoE or dense MLPs that mix no tokens.

The mixer is Bamba's line for line; the decoder passes its kwargs (the boundaries included) to every layer.
"""

from compilepack.patching import ATTENTION, MAMBA2_MIXER, Family, register

register(Family(
    "granitemoehybrid", "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    decoder="GraniteMoeHybridModel",
    layers={"GraniteMoeHybridAttention": (ATTENTION,), "GraniteMoeHybridMambaLayer": MAMBA2_MIXER},
))
