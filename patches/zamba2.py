"""Zamba2: Mamba2 layers (causal conv1d + SSD chunk scan; packed batches take the unfused path), some
preceded by a shared attention block (weights tied across its uses, per-use LoRA-style adapters).

The decoder calls every layer with its kwargs (the boundaries included); the hybrid layer passes them to both
the shared attention block and its Mamba2 layer.
"""

from compilepack.patching import ATTENTION, MAMBA2_MIXER, Family, register

register(Family(
    "zamba2", "transformers.models.zamba2.modeling_zamba2", decoder="Zamba2Model",
    layers={"Zamba2Attention": (ATTENTION,), "Zamba2MambaMixer": MAMBA2_MIXER},
))
