"""LFM3: LFM2's gated short-convolution layers (wider kernel) with sliding-window and full attention layers (q/k
norms, per-head output gate, sandwich norms).

The short conv is LFM2's line for line; the attention passes its ``sliding_window`` to the attention function,
so compilepack's varlen attention applies the window inside each document.
"""

import transformers

from compilepack.patching import ATTENTION, CAUSAL_CONV1D, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "lfm3", "transformers.models.lfm3.modeling_lfm3", decoder="Lfm3Model",
    transformers=">=5.23",  # LFM3 first shipped in transformers 5.23
    layers={"Lfm3Attention": (ATTENTION,), "Lfm3ShortConv": (CAUSAL_CONV1D,)},
    fixtures=Fixtures(
        tiny={
            # a window of 8 tokens, shorter than most test documents
            "hybrid": TinyModel(lambda: transformers.Lfm3Config(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, conv_L_cache=7,
                layer_types=["conv", "sliding_attention", "full_attention", "conv"],
                pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=2048,
            )),
        },
        bench=lambda: transformers.Lfm3Config(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=128, conv_L_cache=7,
            layer_types=["conv", "conv", "full_attention", "conv", "sliding_attention", "conv"],
            pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (short convs reach across document starts); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
            kernels_note="causal-conv1d serves kernel widths 2-4 only: LFM3's default width 7 runs compilepack's "
                         "reference",
        ),
    ),
))
