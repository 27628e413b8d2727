"""Bamba: Mamba2 mixers (causal conv1d + SSD chunk scan) and attention layers.

Packed batches take the mixer's unfused path (see MAMBA2_SPLIT_CONV1D_SCAN): on CUDA its conv and scan run
causal-conv1d's and mamba-ssm's kernels with document resets."""

from compilepack.patching import ATTENTION, MAMBA2_MIXER, Family, register

register(Family(
    "bamba", "transformers.models.bamba.modeling_bamba", decoder="BambaModel",
    layers={"BambaAttention": (ATTENTION,), "BambaMixer": MAMBA2_MIXER},
))
