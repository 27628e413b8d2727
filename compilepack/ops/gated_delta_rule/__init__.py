"""``compilepack::gated_delta_rule_varlen``: the chunked gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) on
packed rows. The recurrent state restarts from zero at every document start, so a packed row gives each document
exactly the output it gets when run alone.

- ``reference.py``: masked chunks in pure torch (any device; what runs on CPU), explicit backward;
- ``fla.py``: flash-linear-attention's chunk kernels (CUDA, ``backend="fla"``);
- ``naive.py``: the token-by-token recurrence per document, the tests' oracle.

``compilepack::gated_delta_rule_varlen_state`` is the same op with a state in and out (each row's first document
starts from a given state; each row's last state is returned): what context parallelism over tokens needs
(``sharded.py``); on CUDA fla's chunk kernels with one initial and final state per document
(``fla.py``).
"""

from __future__ import annotations

from torch import Tensor

from .. import backends
from .._delta_rule import define_delta_rule_op, define_delta_rule_state_op, run_delta_rule, run_delta_rule_state
from . import fla, reference
from .naive import gated_delta_rule_naive

__all__ = ["gated_delta_rule_naive", "gated_delta_rule_varlen", "gated_delta_rule_varlen_state"]


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


def gated_delta_rule_varlen_state(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, initial_state: Tensor,
    use_qk_l2norm: bool = True, scale: float | None = None, *, cu_seqlens_cpu: Tensor | None = None,
    backend: str = backends.REFERENCE,
) -> tuple[Tensor, Tensor]:
    """:func:`gated_delta_rule_varlen` with a state in and out: the first document of each row starts from
    ``initial_state`` ``[B, HV, K, V]`` (instead of zero), and the state after each row's last token (that of its
    last document, whichever it is) is returned, ``[B, HV, K, V]`` in the compute dtype (float32, float64 for
    float64 inputs). Every row start must be a document start (``cu_seqlens`` holds ``b * T``). Differentiable in
    every tensor, ``initial_state`` included.

    Example::

        q, k = torch.randn(2, 1, 8, 2, 16).unbind(0); v = torch.randn(1, 8, 4, 16)
        g, beta = -torch.rand(1, 8, 4), torch.rand(1, 8, 4)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)               # two documents
        o, final = gated_delta_rule_varlen_state(q, k, v, g, beta, cu, torch.randn(1, 4, 16, 16))
        # o: [1, 8, 4, 16] (document 0 continued the given state); final: [1, 4, 16, 16] (document 1's last state)
    """
    return run_delta_rule_state(
        OP_STATE, q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale, cu_seqlens_cpu, backend,
        per_channel_decay=False,
    )


OP_STATE = define_delta_rule_state_op(
    "compilepack::gated_delta_rule_varlen_state", reference.PATH_STATE, fla.PATH_STATE
)
