"""Dense-attention decoders: Llama, and Mistral / Qwen2 / Qwen3 whose layers have the same shape.

Only attention mixes tokens here, so the patch routes it through ``compilepack::varlen_attention``; the
decoder stops building masks from position_ids.
"""

from compilepack.patching import ATTENTION, Family, register

register(Family(
    "llama", "transformers.models.llama.modeling_llama", decoder="LlamaModel",
    layers={"LlamaAttention": (ATTENTION,)},
))

register(Family(
    "mistral", "transformers.models.mistral.modeling_mistral", decoder="MistralModel",
    layers={"MistralAttention": (ATTENTION,)},
))

register(Family(
    "qwen2", "transformers.models.qwen2.modeling_qwen2", decoder="Qwen2Model",
    layers={"Qwen2Attention": (ATTENTION,)},
))

register(Family(
    "qwen3", "transformers.models.qwen3.modeling_qwen3", decoder="Qwen3Model",
    layers={"Qwen3Attention": (ATTENTION,)},
))
