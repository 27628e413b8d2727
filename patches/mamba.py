"""Mamba (Mamba1, attention-free): selective-scan mixers (causal conv1d + selective scan).

transformers' Mamba drops ``**kwargs`` at every level on the way to the scan: ``MambaForCausalLM`` calls its
backbone with a fixed argument list (threaded), the backbone calls each block and the block
its mixer without them, and the mixer calls ``mamba_selective_scan`` / ``mamba_inner_fn`` without them
(threaded, ``boundary_calls``); see ``_mamba1.attention_free_family``.
"""

import transformers

from compilepack.patches._mamba1 import attention_free_family
from compilepack.patching import DocsRow, Fixtures, TinyModel, register

register(attention_free_family(
    "mamba", "Mamba", "transformers.models.mamba.modeling_mamba",
    fixtures=Fixtures(
        tiny={
            "ssm": TinyModel(lambda: transformers.MambaConfig(
                vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
            )),
        },
        bench=lambda: transformers.MambaConfig(
            vocab_size=256, hidden_size=256, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4,
        ),
        docs=DocsRow(
            stock_packed="position_ids only or with the collator's boundary kwargs: silently wrong (the kwargs never "
                         "reach the mixers; every layer scans one long sequence)",
        ),
    ),
))
