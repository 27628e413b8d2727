"""``compilepack::kimi_delta_attention_varlen``: Kimi delta attention (KDA: Kimi Linear) on packed rows. KDA is the
gated delta rule with a per-channel decay: each value head's ``K x V`` state is multiplied row-wise by
``exp(g_t)`` (``g_t`` a K-vector) at every token before the delta-rule write. The state restarts from zero at
every document start, so a packed row gives each document exactly the output it gets when run alone.

Layout: fla's ``chunk_kda`` (and transformers' ``chunk_kimi_delta_attention``), without an initial or final
state: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]``, beta ``[B, T, HV]``.

- ``reference.py``: masked chunks of sub-chunks in pure torch (any device; what runs on CPU), explicit backward;
- ``fla.py``: flash-linear-attention's chunk kernels (CUDA, ``backend="fla"``, key heads up to 256);
- ``naive.py``: the token-by-token recurrence per document, the tests' oracle.
"""

from __future__ import annotations

from torch import Tensor

from ... import backends
from .._chunked import define_delta_rule_op, run_delta_rule
from . import fla, reference
from .naive import kimi_delta_attention_naive

__all__ = ["kimi_delta_attention_naive", "kimi_delta_attention_varlen"]


def kimi_delta_attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, use_qk_l2norm: bool = False,
    scale: float | None = None, *, cu_seqlens_cpu: Tensor | None = None, backend: str = backends.REFERENCE,
) -> Tensor:
    """Kimi delta attention over packed documents; the recurrent state is zero at every document start.

    Args:
        q: queries ``[B, T, H, K]``, any float dtype.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, HV, V]``; ``HV`` a multiple of ``H``: each q/k head serves ``HV // H`` consecutive
            value heads (fla's grouped value attention; Kimi Linear has ``HV == H``).
        g: per-channel log decay ``[B, T, HV, K]`` (entries <= 0, already activated, as Kimi's forget gate
            returns it): row ``c`` of a head's state is multiplied by ``exp(g[..., c])`` at each token.
        beta: write strength ``[B, T, HV]`` (after the sigmoid).
        cu_seqlens: ``int32`` (or ``int64``) ``[N+1]`` document boundaries over the flattened ``B * T`` tokens,
            starting at 0, on the tensors' device. With ``B > 1`` every row edge must also be a document edge.
            Zero-length documents (repeated values) are allowed.
        use_qk_l2norm: L2-normalise q and k over ``K`` inside the op (eps 1e-6, as transformers and fla); Kimi
            Linear passes True.
        scale: query scale; ``K ** -0.5`` when None (the only value transformers uses).
        cu_seqlens_cpu: the same boundaries on the host, if at hand: kernels that need host-side sizes read them
            there instead of copying ``cu_seqlens`` back from the device.
        backend: the CUDA library used when the tensors are on CUDA (``"fla"``; key heads over 256, which fla's
            kernels refuse, run the reference) or ``"reference"``.

    Returns:
        o: ``[B, T, HV, V]`` in q's dtype (the reference computes in fp32, or fp64 for fp64 inputs).
    """
    return run_delta_rule(
        OP, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, cu_seqlens_cpu, backend, per_channel_decay=True
    )


OP = define_delta_rule_op("compilepack::kimi_delta_attention_varlen", reference.PATH, fla.PATH, fla.applies)
