"""LFM2: gated short-convolution layers (a depthwise causal conv1d between input and output gates) and attention
layers with q/k norms.

The short conv calls ``causal_conv1d_fn`` without an activation and with the layer's kwargs (``seq_idx``
included), so compilepack's boundary-aware conv takes it as it is.
"""

from compilepack.patching import ATTENTION, CAUSAL_CONV1D, Family, register

register(Family(
    "lfm2", "transformers.models.lfm2.modeling_lfm2", decoder="Lfm2Model",
    layers={"Lfm2Attention": (ATTENTION,), "Lfm2ShortConv": (CAUSAL_CONV1D,)},
))
