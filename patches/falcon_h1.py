"""Falcon-H1: every layer runs a Mamba2 mixer (causal conv1d + SSD chunk scan; packed batches take the unfused
path) and an attention block side by side on the same input.

The decoder hands both the same kwargs (the boundaries included).
"""

import transformers

from compilepack.patching import ATTENTION, MAMBA2_MIXER, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "falcon_h1", "transformers.models.falcon_h1.modeling_falcon_h1", decoder="FalconH1Model",
    layers={"FalconH1Attention": (ATTENTION,), "FalconH1Mixer": MAMBA2_MIXER},
    fixtures=Fixtures(
        tiny={
            # every layer is hybrid (attention + Mamba2 in parallel); the gate multiplies after the scan
            "hybrid": TinyModel(lambda: transformers.FalconH1Config(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32,
                mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=64,
                max_position_embeddings=2048,
            )),
        },
        bench=lambda: transformers.FalconH1Config(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64,
            mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_chunk_size=128,
            max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (the Mamba2 half of every layer scans one long sequence); "
                         "with the collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed "
                         "sequences apart)",
        ),
    ),
))
