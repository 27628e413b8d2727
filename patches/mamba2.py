"""Mamba2 (attention-free): Mamba2 mixers (causal conv1d + SSD chunk scan).

``Mamba2ForCausalLM.forward`` calls its backbone without ``**kwargs``, so the boundary kwargs are carried across
that call (``kwargs_bridges``); the backbone is the decoder.
"""

from transformers import Mamba2Config

from compilepack.patching import Family, MAMBA2_MIXER, register

register(
    Family(
        name="mamba2",
        modeling="transformers.models.mamba2.modeling_mamba2",
        decoder="Mamba2Model",
        kwargs_bridges={"Mamba2ForCausalLM": "backbone"},
        layers={"Mamba2Mixer": MAMBA2_MIXER},
        tiny_configs={
            "ssm": lambda: Mamba2Config(
                vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, n_groups=2,
                state_size=16, conv_kernel=4, expand=2, chunk_size=64,
            ),
        },
        bench_config=lambda: Mamba2Config(
            vocab_size=256, hidden_size=256, num_hidden_layers=4, num_heads=8, head_dim=64, n_groups=1,
            state_size=64, conv_kernel=4, expand=2, chunk_size=128,
        ),
        kernels="conv: causal-conv1d causal_conv1d_fn(seq_idx); scan: mamba-ssm mamba_chunk_scan_combined(seq_idx)",
        stock_packed=(
            "position_ids only: silently wrong (one long scan); boundary kwargs: dropped by Mamba2ForCausalLM "
            "before the backbone, silently wrong"
        ),
    )
)
