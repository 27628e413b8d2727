"""Qwen2: Llama's layers with biased q/k/v projections.

Only attention mixes tokens, so the patch routes it through ``compilepack::varlen_attention``; the decoder
stops building masks from position_ids.
"""

import transformers

from compilepack.patching import ATTENTION, DocsRow, Family, Fixtures, TinyModel, register

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=2048)

register(Family(
    "qwen2", "transformers.models.qwen2.modeling_qwen2", decoder="Qwen2Model",
    layers={"Qwen2Attention": (ATTENTION,)},
    fixtures=Fixtures(
        tiny={
            "gqa": TinyModel(lambda: transformers.Qwen2Config(**_TINY, num_attention_heads=4, num_key_value_heads=2)),
        },
        bench=lambda: transformers.Qwen2Config(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=4096,
        ),
        docs=DocsRow(
            stock_packed="sdpa: dense T x T mask from position_ids, correct only with use_cache=False",
        ),
    ),
))
