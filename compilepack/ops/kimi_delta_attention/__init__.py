"""``compilepack::kimi_delta_attention_varlen``: Kimi delta attention (KDA: Kimi Linear) on packed rows. KDA is the
gated delta rule with a per-channel decay: each value head's ``K x V`` state is multiplied row-wise by
``exp(g_t)`` (``g_t`` a K-vector) at every token before the delta-rule write. The state restarts from zero at
every document start, so a packed row gives each document exactly the output it gets when run alone.

Layout: fla's ``chunk_kda`` (and transformers' ``chunk_kimi_delta_attention``), without an initial or final
state: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]``, beta ``[B, T, HV]``.

- ``reference.py``: masked chunks of sub-chunks in pure torch (any device; what runs on CPU), explicit backward;
- ``fla.py``: flash-linear-attention's chunk kernels (CUDA, ``backend="fla"``, key heads up to 256);
- ``naive.py``: the token-by-token recurrence per document, the tests' oracle.

``compilepack::kimi_delta_attention_varlen_state``: the same op with a state in and out, for context parallelism over
tokens (as ``compilepack::gated_delta_rule_varlen_state``); on CUDA fla's chunk kernels (``fla.py``).
"""

from __future__ import annotations

from torch import Tensor

from .. import backends
from .._delta_rule import define_delta_rule_op, define_delta_rule_state_op, run_delta_rule, run_delta_rule_state
from . import fla, reference
from .naive import kimi_delta_attention_naive

__all__ = ["kimi_delta_attention_naive", "kimi_delta_attention_varlen", "kimi_delta_attention_varlen_state"]


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


def kimi_delta_attention_varlen_state(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, initial_state: Tensor,
    use_qk_l2norm: bool = False, scale: float | None = None, *, cu_seqlens_cpu: Tensor | None = None,
    backend: str = backends.REFERENCE,
) -> tuple[Tensor, Tensor]:
    """:func:`kimi_delta_attention_varlen` with a state in and out: the first document of each row starts from
    ``initial_state`` ``[B, HV, K, V]``, and each row's state after its last token is returned (``[B, HV, K, V]``,
    compute dtype). Every row start must be a document start. Differentiable in every tensor.

    Example::

        q, k = torch.randn(2, 1, 8, 2, 16).unbind(0); v = torch.randn(1, 8, 2, 16)
        g, beta = -torch.rand(1, 8, 2, 16), torch.rand(1, 8, 2)
        cu = torch.tensor([0, 8], dtype=torch.int32)
        o, final = kimi_delta_attention_varlen_state(q, k, v, g, beta, cu, torch.randn(1, 2, 16, 16))
        # o [1, 8, 2, 16], final [1, 2, 16, 16]
    """
    return run_delta_rule_state(
        OP_STATE, q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale, cu_seqlens_cpu, backend,
        per_channel_decay=True,
    )


OP_STATE = define_delta_rule_state_op(
    "compilepack::kimi_delta_attention_varlen_state", reference.PATH_STATE, fla.PATH_STATE, fla.state_applies
)
