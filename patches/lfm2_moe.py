"""LFM2-MoE: LFM2's gated short-convolution and attention layers, with sparse-MoE feed-forwards after the first
dense layers.

The token mixers are LFM2's line for line; the MoE blocks mix no tokens across positions and stay stock.
"""

from compilepack.patching import ATTENTION, CAUSAL_CONV1D, Family, register

register(Family(
    "lfm2_moe", "transformers.models.lfm2_moe.modeling_lfm2_moe", decoder="Lfm2MoeModel",
    layers={"Lfm2MoeAttention": (ATTENTION,), "Lfm2MoeShortConv": (CAUSAL_CONV1D,)},
))
