"""Mamba2 (attention-free): Mamba2 mixers (causal conv1d + SSD chunk scan).

``Mamba2ForCausalLM.forward`` calls its backbone without ``**kwargs``, so that call is threaded
(``boundary_calls``); the backbone is the decoder. The CausalLM wrapper is also an entry: it drops position_ids,
so a position_ids-only packed row is refused there, before they are lost.
"""

from compilepack.patching import MAMBA2_MIXER, Family, register

register(Family(
    "mamba2", "transformers.models.mamba2.modeling_mamba2", decoder="Mamba2Model",
    layers={"Mamba2Mixer": MAMBA2_MIXER},
    boundary_calls={"Mamba2ForCausalLM": ("self.backbone",)}, entries=("Mamba2ForCausalLM",),
))
