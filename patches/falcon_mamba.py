"""FalconMamba (attention-free): Mamba1 selective-scan mixers with RMS norms on B, C and dt (per token, so
they mix nothing). The boundaries are carried exactly as for Mamba (see ``mamba.py``): bridged from the
CausalLM wrapper to the backbone, threaded from the backbone to each block, to its mixer, and from the mixer
to ``mamba_selective_scan`` / ``mamba_inner_fn``.
"""

from transformers import FalconMambaConfig

from compilepack.patches._mamba1 import MAMBA_INNER, SELECTIVE_SCAN
from compilepack.patching import CAUSAL_CONV1D, Family, register

register(
    Family(
        name="falcon_mamba",
        modeling="transformers.models.falcon_mamba.modeling_falcon_mamba",
        decoder="FalconMambaModel",
        kwargs_bridges={"FalconMambaForCausalLM": "backbone"},
        layers={"FalconMambaMixer": (CAUSAL_CONV1D, SELECTIVE_SCAN, MAMBA_INNER)},
        boundary_calls={
            "FalconMambaModel": ("mixer_block",),
            "FalconMambaBlock": ("self.mixer",),
            "FalconMambaMixer": ("mamba_inner_fn", "mamba_selective_scan"),
        },
        tiny_configs={
            "ssm": lambda: FalconMambaConfig(
                vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
            ),
        },
        bench_config=lambda: FalconMambaConfig(
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
