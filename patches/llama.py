"""Llama: dense attention decoder layers.

Only attention mixes tokens, so the patch routes it through ``compilepack::varlen_attention``; the decoder
stops building masks from position_ids.
"""

import transformers

from compilepack.patching import ATTENTION, Checkpoint, DocsRow, Family, Fixtures, TinyModel, register

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=2048)

register(Family(
    "llama", "transformers.models.llama.modeling_llama", decoder="LlamaModel",
    layers={"LlamaAttention": (ATTENTION,)},
    fixtures=Fixtures(
        tiny={
            "gqa": TinyModel(lambda: transformers.LlamaConfig(**_TINY, num_attention_heads=4, num_key_value_heads=2)),
            "mha": TinyModel(lambda: transformers.LlamaConfig(**_TINY, num_attention_heads=4, num_key_value_heads=4)),
        },
        bench=lambda: transformers.LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=4096,
        ),
        # meta-llama/Llama-3.2-1B (config.json): the smallest Llama 3 release; tied embeddings, llama3 RoPE scaling
        checkpoint=Checkpoint("meta-llama/Llama-3.2-1B", lambda: transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=1, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        )),
        docs=DocsRow(
            stock_packed="sdpa/eager: correct only with use_cache=False, via a dense T x T mask built from "
                         "position_ids",
        ),
    ),
))
