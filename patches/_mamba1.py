"""Replacements shared by the Mamba1 families (Mamba, FalconMamba, Jamba): the selective scan and the fused
``mamba_inner_fn`` training path. A helper module, not a family (the registry skips ``_`` names).

Both switch on a ``seq_idx`` keyword argument, like the other replacements. Note that in transformers 5.24 no
Mamba1 mixer hands ``seq_idx`` to these functions (nor does any block hand the boundaries to its mixer): the
families need the boundary kwargs threaded to these calls first (see tests/patches/test_mamba1_boundaries.py).
"""

from __future__ import annotations

from compilepack.errors import BoundaryError
from compilepack.patching import CAUSAL_CONV1D, Family, Replacement


def _make_selective_scan(stock, backends):
    def mamba_selective_scan(
        hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
        return_last_state=False, use_mambapy=False, use_associative_scan=False, seq_idx=None, **kwargs,
    ):
        if seq_idx is None:
            return stock(
                hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                return_last_state=return_last_state, use_mambapy=use_mambapy,
                use_associative_scan=use_associative_scan,
            )
        if return_last_state:
            raise BoundaryError(
                "selective scan: a packed batch cannot return a recurrent state (a cache); packed forwards run "
                "with use_cache=False."
            )
        from compilepack.ops.selective_scan import selective_scan_varlen

        return selective_scan_varlen(
            hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
            seq_idx=seq_idx, backend=backends.ssd,
        )

    return mamba_selective_scan


SELECTIVE_SCAN = Replacement(
    "mamba_selective_scan",
    _make_selective_scan,
    ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state"),
)


def _make_mamba_inner(stock, backends):
    def mamba_inner_fn(xz, *args, seq_idx=None, **kwargs):
        if seq_idx is None:
            return stock(xz, *args, **kwargs)
        # No fused Mamba1 kernel resets at document starts (mamba-ssm 2.3.2.post1's MambaInnerFn takes no
        # seq_idx), on any device: None sends the stock forward down its unfused path, whose conv and scan are
        # compilepack's boundary-aware ops. Decided from static facts only.
        return None

    return mamba_inner_fn


MAMBA_INNER = Replacement(
    "mamba_inner_fn",
    _make_mamba_inner,
    ("xz", "conv1d_weight", "conv1d_bias", "x_proj_weight", "delta_proj_weight", "out_proj_weight", "A"),
)


def attention_free_family(name: str, prefix: str, config_class, modeling: str) -> Family:
    """A Mamba1 stack without attention (Mamba, FalconMamba): classes ``<prefix>ForCausalLM``, ``<prefix>Model``,
    ``<prefix>Block`` and ``<prefix>Mixer`` that drop ``**kwargs`` at every level on the way to the scan. The
    CausalLM wrapper is bridged to the backbone, the backbone threads the boundaries to each block, the block to
    its mixer and the mixer to ``mamba_selective_scan`` / ``mamba_inner_fn``. Packed batches always take the
    mixer's unfused path: no fused Mamba1 kernel resets at document starts."""
    return Family(
        name=name,
        modeling=modeling,
        decoder=f"{prefix}Model",
        kwargs_bridges={f"{prefix}ForCausalLM": "backbone"},
        layers={f"{prefix}Mixer": (CAUSAL_CONV1D, SELECTIVE_SCAN, MAMBA_INNER)},
        boundary_calls={
            f"{prefix}Model": ("mixer_block",),
            f"{prefix}Block": ("self.mixer",),
            f"{prefix}Mixer": ("mamba_inner_fn", "mamba_selective_scan"),
        },
        tiny_configs={
            "ssm": lambda: config_class(
                vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
            ),
        },
        bench_config=lambda: config_class(
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
