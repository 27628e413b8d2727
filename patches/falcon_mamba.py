"""FalconMamba (attention-free): Mamba1 selective-scan mixers with RMS norms on B, C and dt (per token, so
they mix nothing). The boundaries are carried exactly as for Mamba (``_mamba1.attention_free_family``).
"""

from compilepack.patches._mamba1 import attention_free_family

from compilepack.patching import register

register(attention_free_family("falcon_mamba", "FalconMamba", "transformers.models.falcon_mamba.modeling_falcon_mamba"))
