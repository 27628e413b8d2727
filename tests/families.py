"""Tiny configs of every registered family, for the tests: randomly initialised models (no download) small enough
for 2 CPU cores, with every layer type of the family. Each family has one or more named variants; the first is
its default. A new family adds its entry here (tests/test_repo.py checks that every registered family has one).
Config classes are looked up when a config is built, so a transformers release without a family's classes fails
only that family's tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers
from packaging.version import Version

from compilepack.patching import Family, families

_GRANITE = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=64, max_position_embeddings=2048,
)

_LLAMA_LIKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=2048)

_QWEN3_5_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=2048,
)

_QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

_QWEN3_5_MOE_TEXT = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=2048,
)

_QWEN3_5_MOE_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

TINY_CONFIGS: dict[str, dict[str, Callable[[], transformers.PretrainedConfig]]] = {
    "bamba": {
        "hybrid": lambda: transformers.BambaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
            mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=64, max_position_embeddings=2048,
        ),
    },
    "falcon_h1": {
        # every layer is hybrid (attention + Mamba2 in parallel); the gate multiplies after the scan
        "hybrid": lambda: transformers.FalconH1Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32,
            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=64,
            max_position_embeddings=2048,
        ),
    },
    "falcon_mamba": {
        "ssm": lambda: transformers.FalconMambaConfig(
            vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
        ),
    },
    "granitemoehybrid": {
        # RoPE (as some checkpoints use): positions must restart per document too
        "moe": lambda: transformers.GraniteMoeHybridConfig(
            **_GRANITE, intermediate_size=32, shared_intermediate_size=64, num_local_experts=4,
            num_experts_per_tok=2, position_embedding_type="rope",
        ),
        # no positional embedding, dense MLP (num_local_experts=0), like granite-4.0-h-micro
        "dense": lambda: transformers.GraniteMoeHybridConfig(
            **_GRANITE, intermediate_size=128, shared_intermediate_size=128, num_local_experts=0,
        ),
    },
    "jamba": {
        # Mamba + MLP, Mamba + MoE, attention + MLP, Mamba + MoE
        "hybrid_moe": lambda: transformers.JambaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
            num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=2048,
        ),
    },
    "kimi_linear": {
        "moe": lambda: transformers.KimiLinearConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
            num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            n_group=1, topk_group=1,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        ),
    },
    "lfm2": {
        "hybrid": lambda: transformers.Lfm2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, block_auto_adjust_ff_dim=False,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
            layer_types=["conv", "full_attention", "conv"], max_position_embeddings=2048,
        ),
    },
    "lfm2_moe": {
        # layer 0 dense, layers 1-2 MoE (4 experts, top 2)
        "moe": lambda: transformers.Lfm2MoeConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_dense_layers=1, num_experts=4, num_experts_per_tok=2, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
            layer_types=["conv", "full_attention", "conv"], max_position_embeddings=2048,
        ),
    },
    "lfm3": {
        # a window of 8 tokens, shorter than most test documents
        "hybrid": lambda: transformers.Lfm3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, conv_L_cache=7,
            layer_types=["conv", "sliding_attention", "full_attention", "conv"],
            pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=2048,
        ),
    },
    "llama": {
        "gqa": lambda: transformers.LlamaConfig(**_LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2),
        "mha": lambda: transformers.LlamaConfig(**_LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=4),
    },
    "mamba": {
        "ssm": lambda: transformers.MambaConfig(
            vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
        ),
    },
    "mamba2": {
        "ssm": lambda: transformers.Mamba2Config(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, n_groups=2,
            state_size=16, conv_kernel=4, expand=2, chunk_size=64,
        ),
    },
    "mistral": {
        "sliding": lambda: transformers.MistralConfig(**_LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    },
    "nemotron_h": {
        # one block of each type: Mamba2, MoE, attention, MLP ("ME*-")
        "moe": lambda: transformers.NemotronHConfig(
            vocab_size=256, hidden_size=64, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2,
            chunk_size=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, max_position_embeddings=2048,
        ),
    },
    "olmo_hybrid": {
        "hybrid": lambda: transformers.OlmoHybridConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=32,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            pad_token_id=0, eos_token_id=1, max_position_embeddings=2048,
        ),
    },
    "qwen2": {"gqa": lambda: transformers.Qwen2Config(**_LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2)},
    "qwen3": {"gqa": lambda: transformers.Qwen3Config(**_LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, head_dim=16)},
    "qwen3_5": {
        "text": lambda: transformers.Qwen3_5TextConfig(**_QWEN3_5_TEXT),
        "multimodal": lambda: transformers.Qwen3_5Config(text_config=_QWEN3_5_TEXT, vision_config=_QWEN3_5_VISION),
    },
    "qwen3_5_moe": {
        "text": lambda: transformers.Qwen3_5MoeTextConfig(**_QWEN3_5_MOE_TEXT),
        "multimodal": lambda: transformers.Qwen3_5MoeConfig(text_config=_QWEN3_5_MOE_TEXT, vision_config=_QWEN3_5_MOE_VISION),
    },
    "qwen3_next": {
        "moe": lambda: transformers.Qwen3NextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            max_position_embeddings=2048,
        ),
    },
    "zamba2": {
        # two hybrid layers share one attention block (num_mem_blocks=1), each with its own adapters; RoPE on
        "hybrid": lambda: transformers.Zamba2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
            num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=4, mamba_ngroups=2, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=2, chunk_size=64, num_mem_blocks=1,
            use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True, max_position_embeddings=2048,
        ),
    },
}

# variants built by another class than AutoModelForCausalLM
TINY_BUILDERS = {
    ("qwen3_5", "multimodal"): "Qwen3_5ForConditionalGeneration",
    ("qwen3_5_moe", "multimodal"): "Qwen3_5MoeForConditionalGeneration",
}


# Variants whose tiny config has mixture-of-experts blocks. Before transformers 5.23 their experts run, on CPU,
# transformers' own grouped_mm fallback, whose backward reads a tensor value (`.item()`) and breaks the graph:
# stock code outside the mixers compilepack patches (on CUDA, torch's native grouped_mm runs instead).
MOE_VARIANTS = {
    ("granitemoehybrid", "moe"), ("jamba", "hybrid_moe"), ("kimi_linear", "moe"), ("lfm2_moe", "moe"),
    ("nemotron_h", "moe"), ("qwen3_5_moe", "text"), ("qwen3_5_moe", "multimodal"), ("qwen3_next", "moe"),
}
GROUPED_MM_FALLBACK_BREAKS = Version(transformers.__version__) < Version("5.23")


def available_families() -> list[Family]:
    """The registered families the installed transformers has (and compilepack supports there): the ones the
    registry-wide tests run. On an older release a newer family (LFM3 before 5.23) is left out."""
    return [family for family in families() if family.available]


def variants(family: Family) -> list[str]:
    return list(TINY_CONFIGS[family.name])


def tiny_config(family: Family, variant: str | None = None) -> transformers.PretrainedConfig:
    configs = TINY_CONFIGS[family.name]
    return configs[variant or next(iter(configs))]()


def build_tiny(family: Family, variant: str | None = None) -> torch.nn.Module:
    """A randomly initialised tiny model of ``family`` (its default variant unless named)."""
    variant = variant or next(iter(TINY_CONFIGS[family.name]))
    builder = getattr(transformers, TINY_BUILDERS.get((family.name, variant), "AutoModelForCausalLM"))
    config = tiny_config(family, variant)
    return builder.from_config(config) if hasattr(builder, "from_config") else builder(config)
