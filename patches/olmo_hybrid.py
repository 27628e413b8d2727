"""OLMo Hybrid: Gated DeltaNet layers (causal conv1d + gated delta rule, separate q/k/v projections, beta up to 2)
between attention layers with q/k norms.

The Gated DeltaNet layer passes ``cu_seqlens=kwargs.pop("cu_seq_lens_q")`` to the delta rule and the rest of its
kwargs (``seq_idx`` included) to the conv: both reach compilepack's ops.
"""

from compilepack.patching import ATTENTION, GATED_DELTANET, Family, register

register(Family(
    "olmo_hybrid", "transformers.models.olmo_hybrid.modeling_olmo_hybrid", decoder="OlmoHybridModel",
    layers={"OlmoHybridAttention": (ATTENTION,), "OlmoHybridGatedDeltaNet": GATED_DELTANET},
))
