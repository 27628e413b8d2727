"""FalconMamba (attention-free): Mamba1 selective-scan mixers with RMS norms on B, C and dt (per token, so
they mix nothing). The boundaries are carried exactly as for Mamba (``_mamba1.attention_free_family``).
"""

import transformers

from compilepack.patches._mamba1 import attention_free_family
from compilepack.patching import DocsRow, Fixtures, TinyModel, register

register(attention_free_family(
    "falcon_mamba", "FalconMamba", "transformers.models.falcon_mamba.modeling_falcon_mamba",
    fixtures=Fixtures(
        tiny={
            "ssm": TinyModel(lambda: transformers.FalconMambaConfig(
                vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
            )),
        },
        bench=lambda: transformers.FalconMambaConfig(
            vocab_size=256, hidden_size=256, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4,
        ),
        docs=DocsRow(
            stock_packed="position_ids only or with the collator's boundary kwargs: silently wrong (the kwargs never "
                         "reach the mixers; every layer scans one long sequence)",
        ),
    ),
))
