"""OLMo Hybrid: Gated DeltaNet layers (causal conv1d + gated delta rule, separate q/k/v projections, beta up to 2)
between attention layers with q/k norms.

The Gated DeltaNet layer passes ``cu_seqlens=kwargs.pop("cu_seq_lens_q")`` to the delta rule and the rest of its
kwargs (``seq_idx`` included) to the conv: both reach compilepack's ops.
"""

import transformers

from compilepack.patching import ATTENTION, GATED_DELTANET, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "olmo_hybrid", "transformers.models.olmo_hybrid.modeling_olmo_hybrid", decoder="OlmoHybridModel",
    layers={"OlmoHybridAttention": (ATTENTION,), "OlmoHybridGatedDeltaNet": GATED_DELTANET},
    fixtures=Fixtures(
        tiny={
            "hybrid": TinyModel(lambda: transformers.OlmoHybridConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=32,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                pad_token_id=0, eos_token_id=1, max_position_embeddings=2048,
            )),
        },
        bench=lambda: transformers.OlmoHybridConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=8, linear_num_key_heads=8, linear_num_value_heads=8,
            linear_key_head_dim=24, linear_value_head_dim=48,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            pad_token_id=0, eos_token_id=1, max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (linear layers see one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
        ),
    ),
))
