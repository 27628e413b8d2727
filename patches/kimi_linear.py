"""Kimi Linear: Kimi delta attention (KDA) layers (short causal conv1d on q, k, v + the per-channel gated delta
rule) between MLA full-attention layers (no RoPE). MoE and dense MLP blocks mix no tokens and stay stock.

``chunk_kimi_delta_attention`` (the KDA kernel) is replaced by ``compilepack::kimi_delta_attention_varlen`` on
``cu_seq_lens_q`` (the layer forwards the collator's kwargs to it); CUDA backend: the gated-delta-rule kind's
choice (``fla``), as fla serves both. MLA attention's value head dim differs from its query/key head dim; the
shared attention op pads to one head dim internally.
"""

from compilepack.patching import ATTENTION, KIMI_DELTA_MIXER, Family, register

register(Family(
    "kimi_linear", "transformers.models.kimi_linear.modeling_kimi_linear", decoder="KimiLinearModel",
    layers={"KimiLinearAttention": (ATTENTION,), "KimiLinearDeltaAttention": KIMI_DELTA_MIXER},
))
