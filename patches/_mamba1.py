"""The attention-free Mamba1 stacks (Mamba, FalconMamba), declared alike: a helper module, not a family (the
registry skips ``_`` names)."""

from __future__ import annotations

from compilepack.patching import MAMBA1_FUSED_MIXER, Family, Fixtures


def attention_free_family(name: str, prefix: str, modeling: str, fixtures: Fixtures) -> Family:
    """A Mamba1 stack without attention: classes ``<prefix>ForCausalLM``, ``<prefix>Model``, ``<prefix>Block`` and
    ``<prefix>Mixer`` that drop ``**kwargs`` at every level on the way to the scan, so every one of those calls is
    threaded (the CausalLM wrapper to the backbone, the backbone to each block, the block to its mixer, the mixer
    to ``mamba_selective_scan`` / ``mamba_inner_fn``). Packed batches always take the mixer's unfused path: no fused
    Mamba1 kernel resets at document starts. The CausalLM wrapper is also an entry: it drops position_ids, so a
    position_ids-only packed row is refused there. ``fixtures``: the family's test, bench and docs declarations
    (:class:`~compilepack.patching.Fixtures`)."""
    return Family(
        name, modeling, decoder=f"{prefix}Model",
        layers={f"{prefix}Mixer": MAMBA1_FUSED_MIXER},
        boundary_calls={
            f"{prefix}ForCausalLM": ("self.backbone",),
            f"{prefix}Model": ("mixer_block",),
            f"{prefix}Block": ("self.mixer",),
            f"{prefix}Mixer": ("mamba_inner_fn", "mamba_selective_scan"),
        },
        entries=(f"{prefix}ForCausalLM",), fixtures=fixtures,
    )
