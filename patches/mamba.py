"""Mamba (Mamba1, attention-free): selective-scan mixers (causal conv1d + selective scan).

transformers' Mamba drops ``**kwargs`` at every level on the way to the scan: ``MambaForCausalLM`` calls its
backbone with a fixed argument list (bridged, ``kwargs_bridges``), the backbone calls each block and the block
its mixer without them, and the mixer calls ``mamba_selective_scan`` / ``mamba_inner_fn`` without them
(threaded, ``boundary_calls``). Packed batches always take the mixer's unfused path: no fused Mamba1 kernel
resets at document starts.
"""

from transformers import MambaConfig

from compilepack.patches._mamba1 import MAMBA_INNER, SELECTIVE_SCAN
from compilepack.patching import CAUSAL_CONV1D, Family, register

register(
    Family(
        name="mamba",
        modeling="transformers.models.mamba.modeling_mamba",
        decoder="MambaModel",
        kwargs_bridges={"MambaForCausalLM": "backbone"},
        layers={"MambaMixer": (CAUSAL_CONV1D, SELECTIVE_SCAN, MAMBA_INNER)},
        boundary_calls={
            "MambaModel": ("mixer_block",),
            "MambaBlock": ("self.mixer",),
            "MambaMixer": ("mamba_inner_fn", "mamba_selective_scan"),
        },
        tiny_configs={
            "ssm": lambda: MambaConfig(
                vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
            ),
        },
        bench_config=lambda: MambaConfig(
            vocab_size=256, hidden_size=256, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4,
        ),
        kernels=(
            "conv: causal-conv1d causal_conv1d_fn(seq_idx); selective scan: compilepack's reference on every "
            "device (mamba-ssm's selective scan cannot reset inside a row); fused mamba_inner_fn: never on "
            "packed batches"
        ),
        stock_packed=(
            "position_ids only or with the collator's boundary kwargs: silently wrong (the kwargs never reach "
            "the mixers; every layer scans one long sequence)"
        ),
    )
)
