"""Zamba2: Mamba2 layers (causal conv1d + SSD chunk scan; packed batches take the unfused path), some
preceded by a shared attention block (weights tied across its uses, per-use LoRA-style adapters).

The decoder calls every layer with its kwargs (the boundaries included); the hybrid layer passes them to both
the shared attention block and its Mamba2 layer.
"""

import transformers

from compilepack.patching import ATTENTION, MAMBA2_MIXER, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "zamba2", "transformers.models.zamba2.modeling_zamba2", decoder="Zamba2Model",
    layers={"Zamba2Attention": (ATTENTION,), "Zamba2MambaMixer": MAMBA2_MIXER},
    fixtures=Fixtures(
        tiny={
            # two hybrid layers share one attention block (num_mem_blocks=1), each with its own adapters; RoPE on
            "hybrid": TinyModel(lambda: transformers.Zamba2Config(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
                num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=4, mamba_ngroups=2, mamba_d_state=16,
                mamba_d_conv=4, mamba_expand=2, chunk_size=64, num_mem_blocks=1,
                use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True, max_position_embeddings=2048,
            )),
        },
        bench=lambda: transformers.Zamba2Config(
            vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
            layers_block_type=["linear_attention", "linear_attention", "hybrid"] * 2,
            num_attention_heads=8, num_key_value_heads=8, n_mamba_heads=8, mamba_ngroups=1, mamba_d_state=64,
            mamba_d_conv=4, mamba_expand=2, chunk_size=128, num_mem_blocks=1,
            use_shared_attention_adapter=True, adapter_rank=32, use_mem_rope=True, max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (Mamba2 layers scan one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
