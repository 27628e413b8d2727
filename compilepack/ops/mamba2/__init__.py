"""``compilepack::mamba2_chunk_scan_varlen``: the Mamba2 SSD chunk scan (Bamba, Mamba2, Zamba2, FalconH1,
NemotronH, GraniteMoeHybrid) on packed rows. The state restarts from zero at every document start, so a packed
row gives each document exactly the output it gets when run alone.

Layout as mamba-ssm's ``mamba_chunk_scan_combined`` and transformers' ``mamba2_chunk_scan``: ``x [b, T, H, P]``,
``dt [b, T, H]``, ``A [H]``, ``B``, ``C`` ``[b, T, G, N]`` (head ``h`` reads group ``h // (H // G)``), and
``seq_idx int32 [b, T]``, the document index of every token.

- ``reference.py``: the masked SSD chunk scan in pure torch (any device; what runs on CPU), explicit backward;
- ``mamba_ssm.py``: mamba-ssm's Triton SSD forward and backward (CUDA, ``backend="mamba_ssm"``);
- ``naive.py``: the token-by-token recurrence per document, the tests' oracle.

``compilepack::mamba2_chunk_scan_varlen_state``: the scan from a zero state with what adding an incoming state takes
(each row's final state, the first document's decays): what context parallelism over tokens needs
(``sharded.py``); on CUDA mamba-ssm's chunk scan with ``return_final_states`` (``mamba_ssm.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import backends
from .._scaffold import define_op
from . import mamba_ssm, reference
from .naive import mamba2_chunk_scan_naive

__all__ = ["mamba2_chunk_scan_naive", "mamba2_chunk_scan_varlen", "mamba2_chunk_scan_varlen_state"]


def mamba2_chunk_scan_varlen(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
    *, seq_idx: Tensor, backend: str = backends.REFERENCE,
) -> Tensor:
    """Mamba2 SSD scan over packed documents; the state is zero at every document start.

    Per head, with ``h`` the ``P x N`` state: ``h <- exp(dt_t A) h + dt_t x_t B_t^T``, ``y_t = h C_t + D x_t``.

    Args:
        x: ``[b, T, H, P]`` inputs (heads ``H`` of width ``P``).
        dt: ``[b, T, H]`` raw time steps, processed as transformers' ``mamba2_chunk_scan`` does:
            ``dt + dt_bias``, then softplus if ``dt_softplus``, then clamped to ``dt_limit``.
        A: ``[H]`` decay rates (negative: ``-exp(A_log)``).
        B: ``[b, T, G, N]`` input projections, ``H % G == 0``.
        C: ``[b, T, G, N]`` output projections.
        chunk_size: Python int, the SSD chunk length (the model config's ``mamba_chunk_size``); it changes the
            cost and the rounding, not the math.
        D: ``[H]`` or ``[H, P]`` skip connection, or None.
        dt_bias: ``[H]`` or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: ``(min, max)`` clamp of the processed ``dt``.
        seq_idx: ``int32`` (or ``int64``) ``[b, T]`` document index per token, non-decreasing along each row
            (the collator's ``seq_idx``): a document starts where it changes, and at every row start.
        backend: the CUDA library used when the tensors are on CUDA (``"mamba_ssm"``) or ``"reference"``.

    Returns:
        ``y``: ``[b, T, H, P]``. The reference computes in float32 (float64 if an input is float64) and returns
        that, as transformers' scan returns float32; mamba-ssm's kernel returns ``x.dtype``.
    """
    _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx)
    dt_min, dt_max = (float(limit) for limit in dt_limit)
    y, _ = OP(x, dt, A, B, C, seq_idx.to(torch.int32), D, dt_bias, chunk_size, bool(dt_softplus), dt_min, dt_max,
              backend)
    return y


def _fail(argument: str, expected: str, got) -> None:
    raise ValueError(f"mamba2_chunk_scan_varlen: {argument} must be {expected}, got {got}.")


def _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx) -> None:
    """Errors a caller can fix, from shapes and dtypes only (static facts, safe to trace)."""
    if not isinstance(chunk_size, (int, torch.SymInt)) or chunk_size <= 0:
        _fail("chunk_size", "a positive Python int", repr(chunk_size))
    if x.dim() != 4:
        _fail("x", "[b, T, H, P]", tuple(x.shape))
    batch, total, heads, _ = x.shape
    if dt.shape != (batch, total, heads):
        _fail("dt", f"[b, T, H] = {(batch, total, heads)}", tuple(dt.shape))
    if A.shape != (heads,):
        _fail("A", f"[H] = {(heads,)}", tuple(A.shape))
    if B.dim() != 4 or B.shape[:2] != (batch, total) or heads % B.shape[2] != 0:
        _fail("B", f"[b, T, G, N] with b, T = {(batch, total)} and H = {heads} a multiple of G", tuple(B.shape))
    if C.shape != B.shape:
        _fail("C", f"the shape of B {tuple(B.shape)}", tuple(C.shape))
    if D is not None and D.shape not in ((heads,), (heads, x.shape[3])):
        _fail("D", f"[H] = {(heads,)} or [H, P] = {(heads, x.shape[3])}", tuple(D.shape))
    if dt_bias is not None and dt_bias.shape != (heads,):
        _fail("dt_bias", f"[H] = {(heads,)}", tuple(dt_bias.shape))
    if seq_idx.shape != (batch, total):
        _fail("seq_idx", f"[b, T] = {(batch, total)}", tuple(seq_idx.shape))
    if seq_idx.dtype not in (torch.int32, torch.int64):
        _fail("seq_idx", "an int32 (or int64) tensor of document indices", seq_idx.dtype)
    for name, tensor in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        if not tensor.is_floating_point():
            _fail(name, "a floating-point tensor", tensor.dtype)


def _signature(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, seq_idx: Tensor, D: Tensor | None,
    dt_bias: Tensor | None, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float, backend: str,
): ...


OP = define_op(
    "compilepack::mamba2_chunk_scan_varlen",
    signature=_signature,
    differentiable=("x", "dt", "A", "B", "C", "D", "dt_bias"),
    reference=reference.PATH,
    kernels={"mamba_ssm": mamba_ssm.PATH},
    saves_output=True,  # mamba-ssm's backward takes the forward's output
    boundaries=("seq_idx",),
    kind="ssd",
)


def mamba2_chunk_scan_varlen_state(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
    *, seq_idx: Tensor, backend: str = backends.REFERENCE,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`mamba2_chunk_scan_varlen` and what it takes to add an incoming state afterwards: ``(y, final,
    alpha)``, all in the compute dtype and differentiable.

    The state is affine in a row's incoming state ``h_in [b, H, P, N]`` (the state its first document continues):
    with it, the outputs are ``y + alpha[..., None] * einsum("bthn,bhpn->bthp", C_per_head, h_in)`` and the state
    after the row's last token is ``final + alpha[:, -1, :, None, None] * h_in``.

    Returns:
        y: ``[b, T, H, P]``, the scan from a zero state (as :func:`mamba2_chunk_scan_varlen`);
        final: ``[b, H, P, N]``, each row's state after its last token (its last document's);
        alpha: ``[b, T, H]``, the decay from the row start to each token of the row's first document (the product
        of ``exp(dt_s A)``), 0 on the other tokens.

    Example::

        x, dt = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4)
        B, C = torch.randn(2, 1, 8, 2, 16).unbind(0)
        y, final, alpha = mamba2_chunk_scan_varlen_state(x, dt, -torch.rand(4), B, C, 4, dt_softplus=True,
                                                         seq_idx=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))
        # y [1, 8, 4, 8]; final [1, 4, 8, 16] (document 1's); alpha [1, 8, 4], 0 from token 3 on
    """
    _check_inputs(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx)
    dt_min, dt_max = (float(limit) for limit in dt_limit)
    y, final, alpha, _ = OP_STATE(x, dt, A, B, C, seq_idx.to(torch.int32), D, dt_bias, chunk_size, bool(dt_softplus),
                                  dt_min, dt_max, backend)
    return y, final, alpha


OP_STATE = define_op(
    "compilepack::mamba2_chunk_scan_varlen_state",
    signature=_signature,
    outputs=("y", "final_state", "alpha"),
    differentiable=("x", "dt", "A", "B", "C", "D", "dt_bias"),
    reference=reference.PATH_STATE,
    kernels={"mamba_ssm": mamba_ssm.PATH_STATE},
    boundaries=("seq_idx",),
    follows="mamba2_chunk_scan_varlen",  # the state pass: the scan's own choice
)
