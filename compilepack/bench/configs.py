"""The models the benchmark trains, one per family: randomly initialised (no download), hidden 256 and one layer
of each mixer kind for the default families, so that every mode's cold compile fits the default run's budget on 2
CPU cores. ``python -m compilepack explain`` uses them too. A new family adds its entry here (the tests check
that every registered family has one). Config classes are looked up when a config is built, so a transformers
release without one family's classes fails only that family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers

BENCH_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "bamba": lambda: transformers.BambaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, attn_layer_indices=[1],
        mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=128, max_position_embeddings=4096,
    ),
    "falcon_h1": lambda: transformers.FalconH1Config(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_chunk_size=128,
        max_position_embeddings=4096,
    ),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(
        vocab_size=256, hidden_size=256, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4,
    ),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        vocab_size=256, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        intermediate_size=128, shared_intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=128, max_position_embeddings=4096,
    ),
    "jamba": lambda: transformers.JambaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
        num_experts=4, num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, max_position_embeddings=4096,
    ),
    "kimi_linear": lambda: transformers.KimiLinearConfig(
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
    "lfm2": lambda: transformers.Lfm2Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, block_auto_adjust_ff_dim=False,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, conv_L_cache=3,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        max_position_embeddings=4096,
    ),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_dense_layers=1, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, conv_L_cache=3,
        layer_types=["conv", "conv", "full_attention", "conv"], max_position_embeddings=4096,
    ),
    "lfm3": lambda: transformers.Lfm3Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=128, conv_L_cache=7,
        layer_types=["conv", "conv", "full_attention", "conv", "sliding_attention", "conv"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096,
    ),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096,
    ),
    "mamba": lambda: transformers.MambaConfig(
        vocab_size=256, hidden_size=256, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4,
    ),
    "mamba2": lambda: transformers.Mamba2Config(
        vocab_size=256, hidden_size=256, num_hidden_layers=4, num_heads=8, head_dim=64, n_groups=1,
        state_size=64, conv_kernel=4, expand=2, chunk_size=128,
    ),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096, sliding_window=512,
    ),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        vocab_size=256, hidden_size=256,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "mlp", "full_attention", "mlp"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=1536,
        mamba_num_heads=8, mamba_head_dim=64, n_groups=1, ssm_state_size=64, conv_kernel=4, expand=2,
        chunk_size=128, max_position_embeddings=4096,
    ),
    "olmo_hybrid": lambda: transformers.OlmoHybridConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, linear_num_key_heads=8, linear_num_value_heads=8,
        linear_key_head_dim=24, linear_value_head_dim=48,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        pad_token_id=0, eos_token_id=1, max_position_embeddings=4096,
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096,
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
    ),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096,
    ),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        max_position_embeddings=4096,
    ),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        # dense MLPs: the MoE block is stock in both models and adds 10-15 s to every cold compile, which
        # the bench's 10-minute budget cannot spare (the tiny test configs keep the experts)
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        mlp_only_layers=[0, 1], layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096,
    ),
    "zamba2": lambda: transformers.Zamba2Config(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
        layers_block_type=["linear_attention", "linear_attention", "hybrid"] * 2,
        num_attention_heads=8, num_key_value_heads=8, n_mamba_heads=8, mamba_ngroups=1, mamba_d_state=64,
        mamba_d_conv=4, mamba_expand=2, chunk_size=128, num_mem_blocks=1,
        use_shared_attention_adapter=True, adapter_rank=32, use_mem_rope=True, max_position_embeddings=4096,
    ),
}


# ``--widths real``: each mission family at the widths of its smallest released checkpoint (hidden size, heads and
# head dims, key/value heads, GDN / Mamba2 / conv sizes, MLP, vocabulary), at reduced depth: one decoder layer of
# each kind the family mixes. Values are those of the checkpoint's public config.json (nothing is downloaded); where
# a value is not the checkpoint's, the comment says what replaced it and why.
REAL_WIDTH_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    # meta-llama/Llama-3.2-1B (config.json): the smallest Llama 3 release; tied embeddings, llama3 RoPE scaling
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct (config.json; also transformers' Qwen3NextConfig docstring checkpoint), the
    # only Qwen3-Next release. Its 512 experts (10 routed + 1 shared of 512 per token) are replaced by a dense MLP
    # of the config's own intermediate_size 5120 (mlp_only_layers): about the active expert width per token
    # (5632), without the 1.6 B expert parameters per layer that cannot be held on the bench machine; the MoE is
    # stock code in both models.
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, mlp_only_layers=[0, 1], layer_types=["linear_attention", "full_attention"],
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
    # Qwen/Qwen3.5-0.8B (text_config of config.json): the smallest Qwen3.5 release; tied embeddings, gated attention
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
    # ibm-ai-platform/Bamba-9B (config.json), the smallest Bamba release; mamba_d_head 64, d_state 128, n_groups 1
    # as transformers' models/bamba/convert_mamba_ssm_checkpoint.py sets them for it; vocabulary of Llama 3's
    # tokenizer (128256); untied embeddings
    "bamba": lambda: transformers.BambaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[1],
        mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=262144,
    ),
}

WIDTHS = {"bench": BENCH_CONFIGS, "real": REAL_WIDTH_CONFIGS}


def bench_config(family_name: str, widths: str = "bench") -> transformers.PretrainedConfig:
    """The family's bench config: ``widths="bench"`` the small default, ``"real"`` its smallest release's widths."""
    configs = WIDTHS[widths]
    if family_name not in configs:
        have = ", ".join(sorted(configs))
        raise KeyError(f"no {widths}-width bench config for family {family_name!r} (families with one: {have}); "
                       "add one to compilepack/bench/configs.py.")
    return configs[family_name]()


def build_bench_model(family_name: str) -> torch.nn.Module:
    """The benchmark's model of ``family_name``, randomly initialised."""
    return transformers.AutoModelForCausalLM.from_config(bench_config(family_name))
