"""LFM2: gated short-convolution layers (a depthwise causal conv1d between input and output gates) and attention
layers with q/k norms.

The short conv calls ``causal_conv1d_fn`` without an activation and with the layer's kwargs (``seq_idx``
included), so compilepack's boundary-aware conv takes it as it is.
"""

import transformers

from compilepack.patching import ATTENTION, CAUSAL_CONV1D, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "lfm2", "transformers.models.lfm2.modeling_lfm2", decoder="Lfm2Model",
    layers={"Lfm2Attention": (ATTENTION,), "Lfm2ShortConv": (CAUSAL_CONV1D,)},
    fixtures=Fixtures(
        tiny={
            "hybrid": TinyModel(lambda: transformers.Lfm2Config(
                vocab_size=256, hidden_size=64, intermediate_size=128, block_auto_adjust_ff_dim=False,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
                layer_types=["conv", "full_attention", "conv"], max_position_embeddings=2048,
            )),
        },
        bench=lambda: transformers.Lfm2Config(
            vocab_size=256, hidden_size=256, intermediate_size=512, block_auto_adjust_ff_dim=False,
            num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, conv_L_cache=3,
            layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
            max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (short convs reach across document starts); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
