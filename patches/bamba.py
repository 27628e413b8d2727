"""Bamba: Mamba2 mixers (causal conv1d + SSD chunk scan) and attention layers.

Packed batches take the mixer's unfused path (see MAMBA2_SPLIT_CONV1D_SCAN): on CUDA its conv and scan run
causal-conv1d's and mamba-ssm's kernels with document resets."""

import transformers

from compilepack.patching import ATTENTION, MAMBA2_MIXER, Checkpoint, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "bamba", "transformers.models.bamba.modeling_bamba", decoder="BambaModel",
    layers={"BambaAttention": (ATTENTION,), "BambaMixer": MAMBA2_MIXER},
    fixtures=Fixtures(
        tiny={
            "hybrid": TinyModel(lambda: transformers.BambaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
                mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                mamba_expand=2, mamba_chunk_size=64, max_position_embeddings=2048,
            )),
        },
        bench=lambda: transformers.BambaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, attn_layer_indices=[1],
            mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=128, max_position_embeddings=4096,
        ),
        # ibm-ai-platform/Bamba-9B (config.json), the smallest Bamba release; mamba_d_head 64, d_state 128, n_groups 1
        # as transformers' models/bamba/convert_mamba_ssm_checkpoint.py sets them for it; vocabulary of Llama 3's
        # tokenizer (128256); untied embeddings
        checkpoint=Checkpoint("ibm-ai-platform/Bamba-9B", lambda: transformers.BambaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
            num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[1],
            mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            max_position_embeddings=262144,
        )),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (Mamba2 layers scan one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
