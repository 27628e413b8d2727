"""Kimi Linear: Kimi delta attention (KDA) layers (short causal conv1d on q, k, v + the per-channel gated delta
rule) between MLA full-attention layers (no RoPE). MoE and dense MLP blocks mix no tokens and stay stock.

``chunk_kimi_delta_attention`` (the KDA kernel) is replaced by ``compilepack::kimi_delta_attention_varlen`` on
``cu_seq_lens_q`` (the layer forwards the collator's kwargs to it); CUDA backend: the gated-delta-rule kind's
choice (``fla``), as fla serves both. MLA attention's value head dim differs from its query/key head dim; the
shared attention op pads to one head dim internally.
"""

import transformers

from compilepack.patching import ATTENTION, KIMI_DELTA_MIXER, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "kimi_linear", "transformers.models.kimi_linear.modeling_kimi_linear", decoder="KimiLinearModel",
    layers={"KimiLinearAttention": (ATTENTION,), "KimiLinearDeltaAttention": KIMI_DELTA_MIXER},
    fixtures=Fixtures(
        tiny={
            "moe": TinyModel(lambda: transformers.KimiLinearConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
                num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                n_group=1, topk_group=1,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                mlp_layer_types=["dense", "sparse", "sparse"],
                max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            ), moe=True),
        },
        bench=lambda: transformers.KimiLinearConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            linear_num_heads=4, linear_head_dim=64, linear_conv_kernel_dim=4,
            num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
            n_group=1, topk_group=1,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (KDA layers see one long sequence); with the "
                         "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
            kernels_note="MLA attention: values padded to the q/k head dim inside the op",
        ),
    ),
))
