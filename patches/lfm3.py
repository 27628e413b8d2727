"""LFM3: LFM2's gated short-convolution layers (wider kernel) with sliding-window and full attention layers (q/k
norms, per-head output gate, sandwich norms).

The short conv is LFM2's line for line; the attention passes its ``sliding_window`` to the attention function,
so compilepack's varlen attention applies the window inside each document.
"""

from compilepack.patching import ATTENTION, CAUSAL_CONV1D, Family, register

register(Family(
    "lfm3", "transformers.models.lfm3.modeling_lfm3", decoder="Lfm3Model",
    transformers=">=5.23",  # LFM3 first shipped in transformers 5.23
    layers={"Lfm3Attention": (ATTENTION,), "Lfm3ShortConv": (CAUSAL_CONV1D,)},
))
