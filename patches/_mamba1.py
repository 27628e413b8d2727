"""Replacements shared by the Mamba1 families (Mamba, FalconMamba, Jamba): the selective scan and the fused
``mamba_inner_fn`` training path. A helper module, not a family (the registry skips ``_`` names).

Both switch on a ``seq_idx`` keyword argument, like the other replacements. Note that in transformers 5.24 no
Mamba1 mixer hands ``seq_idx`` to these functions (nor does any block hand the boundaries to its mixer): the
families need the boundary kwargs threaded to these calls first (see tests/patches/test_mamba1_boundaries.py).
"""

from __future__ import annotations

from compilepack.errors import BoundaryError
from compilepack.patching import Replacement


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
