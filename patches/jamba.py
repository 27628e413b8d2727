"""Jamba: Mamba1 selective-scan layers and attention layers, each followed by a dense MLP or a sparse MoE
block (per token, so it mixes nothing).

The decoder hands its kwargs (the boundaries included) to every layer, but the Mamba layer calls its mixer
without them and the mixer calls ``mamba_selective_scan`` without them: both calls are threaded
(``boundary_calls``). Jamba's mixer never takes a fused path.
"""

from compilepack.patching import ATTENTION, MAMBA1_MIXER, Family, register

register(Family(
    "jamba", "transformers.models.jamba.modeling_jamba", decoder="JambaModel",
    layers={"JambaAttention": (ATTENTION,), "JambaMambaMixer": MAMBA1_MIXER},
    boundary_calls={"JambaMambaDecoderLayer": ("self.mamba",), "JambaMambaMixer": ("mamba_selective_scan",)},
))
