"""Nemotron-H: a stack of single-mixer blocks, Mamba2 (causal conv1d + SSD chunk scan; packed batches take the unfused
path), attention (no positional embedding), MLP or MoE.

Only the Mamba2 and attention blocks mix tokens; the decoder hands them its kwargs (the boundaries included).
"""

from compilepack.patching import ATTENTION, MAMBA2_MIXER, Family, register

register(Family(
    "nemotron_h", "transformers.models.nemotron_h.modeling_nemotron_h", decoder="NemotronHModel",
    layers={"NemotronHAttention": (ATTENTION,), "NemotronHMamba2Mixer": MAMBA2_MIXER},
))
