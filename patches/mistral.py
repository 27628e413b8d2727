"""Mistral: Llama's layers with sliding-window attention (the window applies inside each document).

Only attention mixes tokens, so the patch routes it through ``compilepack::varlen_attention``; the decoder
stops building masks from position_ids.
"""

import transformers

from compilepack.patching import ATTENTION, DocsRow, Family, Fixtures, TinyModel, register

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=2048)

register(Family(
    "mistral", "transformers.models.mistral.modeling_mistral", decoder="MistralModel",
    layers={"MistralAttention": (ATTENTION,)},
    fixtures=Fixtures(
        tiny={
            "sliding": TinyModel(lambda: transformers.MistralConfig(
                **_TINY, num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
            )),
        },
        bench=lambda: transformers.MistralConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=4096, sliding_window=512,
        ),
        docs=DocsRow(
            stock_packed="sdpa: dense T x T mask from position_ids, correct only with use_cache=False",
        ),
    ),
))
