"""Mamba (Mamba1, attention-free): selective-scan mixers (causal conv1d + selective scan).

transformers' Mamba drops ``**kwargs`` at every level on the way to the scan: ``MambaForCausalLM`` calls its
backbone with a fixed argument list (threaded), the backbone calls each block and the block
its mixer without them, and the mixer calls ``mamba_selective_scan`` / ``mamba_inner_fn`` without them
(threaded, ``boundary_calls``); see ``_mamba1.attention_free_family``.
"""

from compilepack.patches._mamba1 import attention_free_family

from compilepack.patching import register

register(attention_free_family("mamba", "Mamba", "transformers.models.mamba.modeling_mamba"))
