"""``compilepack::gated_delta_rule_varlen``: the chunked gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) on
packed rows. The recurrent state restarts from zero at every document start, so a packed row gives each document
exactly the output it gets when run alone.

- ``reference.py``: masked chunks in pure torch (any device; what runs on CPU), explicit backward;
- ``fla.py``: flash-linear-attention's chunk kernels (CUDA, ``backend="fla"``);
- ``naive.py``: the token-by-token recurrence per document, the tests' oracle.
"""

from __future__ import annotations

from torch import Tensor

from ... import backends
from .._chunked import define_delta_rule_op, run_delta_rule
from . import fla, reference
from .naive import gated_delta_rule_naive

__all__ = ["gated_delta_rule_naive", "gated_delta_rule_varlen"]


def gated_delta_rule_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    *,
    cu_seqlens_cpu: Tensor | None = None,
    backend: str = backends.REFERENCE,
) -> Tensor:
    """Gated delta rule over packed documents; the recurrent state is zero at every document start.

    Args:
        q: queries ``[B, T, H, K]`` (fla layout), any float dtype.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, HV, V]``; ``HV`` a multiple of ``H``: each q/k head serves ``HV // H`` consecutive
            value heads (grouped value attention, as ``repeat_interleave`` in transformers).
        g: log decay ``[B, T, HV]`` (entries <= 0): the state is multiplied by ``exp(g)`` at each token.
        beta: write strength ``[B, T, HV]``.
        cu_seqlens: ``int32`` (or ``int64``) ``[N+1]`` document boundaries over the flattened ``B * T`` tokens,
            starting at 0, on the tensors' device. With ``B > 1`` every row edge must also be a document edge.
            Zero-length documents (repeated values) are allowed.
        use_qk_l2norm: L2-normalise q and k over ``K`` inside the op (eps 1e-6, as transformers and fla).
        scale: query scale; ``K ** -0.5`` when None.
        cu_seqlens_cpu: the same boundaries on the host, if at hand: kernels that need host-side sizes read them
            there instead of copying ``cu_seqlens`` back from the device.
        backend: the CUDA library used when the tensors are on CUDA (``"fla"``) or ``"reference"``.

    Returns:
        o: ``[B, T, HV, V]`` in q's dtype (the reference computes in fp32, or fp64 for fp64 inputs).
    """
    return run_delta_rule(
        OP, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, cu_seqlens_cpu, backend, per_channel_decay=False
    )


OP = define_delta_rule_op("compilepack::gated_delta_rule_varlen", reference.PATH, fla.PATH)
