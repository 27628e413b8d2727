"""Dense-attention decoders: Llama, and Mistral / Qwen2 / Qwen3 whose layers have the same shape.

Only attention mixes tokens here, so the patch routes it through ``compilepack::varlen_attention``; the
decoder stops building masks from position_ids.
"""

from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from compilepack.patching import ATTENTION, Family, register

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=2048)

register(
    Family(
        name="llama",
        modeling="transformers.models.llama.modeling_llama",
        decoder="LlamaModel",
        layers={"LlamaAttention": (ATTENTION,)},
        tiny_configs={
            "gqa": lambda: LlamaConfig(**_TINY, num_attention_heads=4, num_key_value_heads=2),
            "mha": lambda: LlamaConfig(**_TINY, num_attention_heads=4, num_key_value_heads=4),
        },
        bench_config=lambda: LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=4096,
        ),
        kernels="attention: flash-attn varlen, else torch varlen_attn (CUDA); per-document CPU flash kernel (CPU)",
        stock_packed="sdpa/eager: correct only with use_cache=False, via a dense T x T mask built from position_ids",
    )
)

register(
    Family(
        name="mistral",
        modeling="transformers.models.mistral.modeling_mistral",
        decoder="MistralModel",
        layers={"MistralAttention": (ATTENTION,)},
        tiny_configs={
            "sliding": lambda: MistralConfig(**_TINY, num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
        },
        kernels="attention (sliding window): flash-attn varlen, else torch varlen_attn (CUDA); CPU per-document",
        stock_packed="sdpa: dense T x T mask from position_ids, correct only with use_cache=False",
    )
)

register(
    Family(
        name="qwen2",
        modeling="transformers.models.qwen2.modeling_qwen2",
        decoder="Qwen2Model",
        layers={"Qwen2Attention": (ATTENTION,)},
        tiny_configs={"gqa": lambda: Qwen2Config(**_TINY, num_attention_heads=4, num_key_value_heads=2)},
        kernels="attention: flash-attn varlen, else torch varlen_attn (CUDA); CPU per-document",
        stock_packed="sdpa: dense T x T mask from position_ids, correct only with use_cache=False",
    )
)

register(
    Family(
        name="qwen3",
        modeling="transformers.models.qwen3.modeling_qwen3",
        decoder="Qwen3Model",
        layers={"Qwen3Attention": (ATTENTION,)},
        tiny_configs={"gqa": lambda: Qwen3Config(**_TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16)},
        kernels="attention: flash-attn varlen, else torch varlen_attn (CUDA); CPU per-document",
        stock_packed="sdpa: dense T x T mask from position_ids, correct only with use_cache=False",
    )
)
