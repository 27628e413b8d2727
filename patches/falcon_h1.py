"""Falcon-H1: every layer runs a Mamba2 mixer (causal conv1d + SSD chunk scan; packed batches take the unfused
path) and an attention block side by side on the same input.

The decoder hands both the same kwargs (the boundaries included).
"""

from compilepack.patching import ATTENTION, MAMBA2_MIXER, Family, register

register(Family(
    "falcon_h1", "transformers.models.falcon_h1.modeling_falcon_h1", decoder="FalconH1Model",
    layers={"FalconH1Attention": (ATTENTION,), "FalconH1Mixer": MAMBA2_MIXER},
))
