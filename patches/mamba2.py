"""Mamba2 (attention-free): Mamba2 mixers (causal conv1d + SSD chunk scan).

``Mamba2ForCausalLM.forward`` calls its backbone without ``**kwargs``, so that call is threaded
(``boundary_calls``); the backbone is the decoder. The CausalLM wrapper is also an entry: it drops position_ids,
so a position_ids-only packed row is refused there, before they are lost.
"""

import transformers

from compilepack.patching import MAMBA2_MIXER, DocsRow, Family, Fixtures, TinyModel, register

register(Family(
    "mamba2", "transformers.models.mamba2.modeling_mamba2", decoder="Mamba2Model",
    layers={"Mamba2Mixer": MAMBA2_MIXER},
    boundary_calls={"Mamba2ForCausalLM": ("self.backbone",)}, entries=("Mamba2ForCausalLM",),
    fixtures=Fixtures(
        tiny={
            "ssm": TinyModel(lambda: transformers.Mamba2Config(
                vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, n_groups=2,
                state_size=16, conv_kernel=4, expand=2, chunk_size=64,
            )),
        },
        bench=lambda: transformers.Mamba2Config(
            vocab_size=256, hidden_size=256, num_hidden_layers=4, num_heads=8, head_dim=64, n_groups=1,
            state_size=64, conv_kernel=4, expand=2, chunk_size=128,
        ),
        docs=DocsRow(
            stock_packed="position_ids only: silently wrong (one long scan); boundary kwargs: dropped by "
                         "Mamba2ForCausalLM before the backbone, silently wrong",
        ),
    ),
))
