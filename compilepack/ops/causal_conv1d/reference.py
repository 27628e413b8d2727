"""The causal conv's fast pure-torch path (any device; what runs on CPU): shift and mask.

Inside, the ``B * T`` tokens are the rows of one contiguous ``[N, D]`` (a free view of channel-last x), and
``same[s]`` (``0 <= s < W``) is 1 for the tokens whose tap ``s`` back lies in their own document and row, else 0
(``same[0] = 1``). Then, with ``g`` the gradient of the pre-activation (``grad_out * silu'`` when silu is fused; its
input is recomputed in the backward, as the CUDA kernel does, so only the inputs are saved):

- forward: ``out[n] = b + sum_s w[W-1-s] * (same[s][n] * x[n-s])``;
- dx:      ``dx[n] = sum_s w[W-1-s] * (same[s][n+s] * g[n+s])``;
- dweight: ``dweight[W-1-s] = sum_n same[s][n] * (g[n] * x[n-s])`` (one matrix-vector product per tap);
- dbias:   ``sum_n g[n]``.

Every tap is multiplied by its 0/1 factor before it is summed, never subtracted afterwards, so a document's
outputs and gradients do not depend on another document's (finite) values, not even by rounding; and nothing
reads tensor data on the host, so no device sync.

On CPU, from ``CONV2D_MIN_ELEMENTS`` on, the forward and dx take a faster exact route instead: the boundary-blind
conv as one NHWC depthwise ``conv2d`` (oneDNN), then the rows it got wrong (fewer than W-1 tokens after a document
start, or before a document end, found with ``nonzero``: free on CPU) recomputed from their masked taps. The
other rows' taps all lie in their own document, so every row is exact either way.

Computes in float32 at least (as the CUDA kernel accumulates), float64 for float64 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._chunked import compute_dtype
from .._scaffold import Path

# From this many elements (B*T*D) on, CPU runs the blind conv as one depthwise conv2d and fixes the boundary rows.
# Measured on 1 thread (16 documents, W=4, silu; compute only, with malloc keeping freed memory): T=2048, D=1024
# forward 2.4 ms vs 3.9 ms for shift and mask (each of its W-1 taps is two passes), backward 11.5 vs 14.2 ms; at
# 2^19 elements the two are even; below, shift and mask is the faster (oneDNN opens an OpenMP region even for tiny
# inputs, and the fix-up's gathers cost a fixed overhead).
CONV2D_MIN_ELEMENTS = 1 << 19


def forward(x, weight, bias, seq_idx, silu: bool):
    """``out`` ``[B, D, T]`` in x's dtype, channel-last (the transpose of a contiguous ``[B, T, D]``); no saved."""
    conv = _Conv(x, weight, seq_idx)
    out_ND = conv.causal(_rows(x, conv.dtype), _bias_of(bias, conv.dtype))[: conv.tokens]
    if silu:
        F.silu(out_ND, inplace=True)
    return _channel_last(out_ND.to(x.dtype), x), []


def fake(x, weight, bias, seq_idx, silu: bool):
    batch, dim, seqlen = x.shape
    return x.new_empty((batch, seqlen, dim)).transpose(1, 2), []


def backward(grad_out, out, saved, needs_grad, x, weight, bias, seq_idx, silu: bool):
    """``(dx, dweight, dbias)``, None where not needed. dx is channel-last: for channel-last x of the compute dtype
    that is ``empty_like(x)``'s layout, so the scaffold hands it on without a copy."""
    need_dx, need_dweight, need_dbias = needs_grad
    conv = _Conv(x, weight, seq_idx)
    x_ND = _rows(x, conv.dtype)
    scratch_ND = torch.empty_like(x_ND)  # one buffer for every pass's temporaries: fresh ones cost page faults
    grad_ND = _rows(grad_out, conv.dtype)
    padded_ND = None
    if silu:
        # silu's gradient overwrites its recomputed input, whose W-1 spare rows become dx's zero padding
        padded_ND = conv.causal(x_ND, _bias_of(bias, conv.dtype), scratch_ND)
        pre_ND = padded_ND[: conv.tokens]
        grad_ND = torch.ops.aten.silu_backward.grad_input(grad_ND, pre_ND, grad_input=pre_ND)
    dx = _channel_last(conv.anti_causal(grad_ND, padded_ND, scratch_ND), x) if need_dx else None
    dweight = conv.weight_grad(grad_ND, x_ND, scratch_ND).t() if need_dweight else None
    dbias = grad_ND.sum(0) if need_dbias else None
    return dx, dweight, dbias


PATH = Path(forward=forward, backward=backward, fake=fake)


def same_document(seq_idx: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """``[N, W]`` 0/1 factors: ``same[n, s]`` is 1 where the token ``s`` back from n is in n's row and document.

    Ids are non-decreasing along a row, so equal ids ``s`` apart mean no document start in between; the first ``s``
    tokens of a row have no tap ``s`` back in the row. Factors rather than ``where``: torch's ``where`` does not
    vectorise a broadcast condition (5x slower on CPU), and ``v * 0`` is an exact zero for finite ``v``."""
    rows, seqlen = seq_idx.shape
    same_BTW = seq_idx.new_zeros((rows, seqlen, width), dtype=dtype)
    for shift in range(width):
        same_BTW[:, shift:, shift] = seq_idx[:, shift:] == seq_idx[:, : max(seqlen - shift, 0)]
    return same_BTW.view(rows * seqlen, width)


class _Conv:
    """The weights and document masks of one call, and the convolutions over its ``[N, D]`` token rows."""

    def __init__(self, x: Tensor, weight: Tensor, seq_idx: Tensor):
        self.dtype = torch.promote_types(compute_dtype(x), compute_dtype(weight))
        self.w_WD = weight.t().to(self.dtype).contiguous()  # one contiguous row per tap
        self.width = weight.shape[1]
        self.tokens = x.shape[0] * x.shape[2]
        self.same_NW = same_document(seq_idx.to(x.device), self.width, self.dtype)
        self.fix_rows = x.device.type == "cpu" and x.numel() >= CONV2D_MIN_ELEMENTS

    def weight_of(self, shift: int) -> Tensor:
        """The weight of the tap ``shift`` tokens back: ``w[W-1-shift]``, ``[D]``."""
        return self.w_WD[self.width - 1 - shift]

    def causal(self, x_ND: Tensor, bias_D: Tensor | None, scratch_ND: Tensor | None = None) -> Tensor:
        """``out[n] = b + sum_s w[W-1-s] x[n-s]`` over the taps in n's document: rows ``[0, N)`` of a fresh
        ``[N + W-1, D]`` buffer (the spare rows hold junk)."""
        if self.fix_rows:
            padded_ND = _conv2d(x_ND, self.w_WD, bias_D, padding=self.width - 1)
            self._fix_rows(padded_ND, x_ND, bias_D, backwards=False)
            return padded_ND
        padded_ND = x_ND.new_empty((self.tokens + self.width - 1, x_ND.shape[1]))
        out_ND = padded_ND[: self.tokens]
        if bias_D is None:
            torch.mul(x_ND, self.weight_of(0), out=out_ND)
        else:
            torch.addcmul(bias_D, x_ND, self.weight_of(0), out=out_ND)
        scratch_ND = torch.empty_like(x_ND) if scratch_ND is None else scratch_ND
        for shift in range(1, self.width):
            masked = torch.mul(x_ND[:-shift], self.same_NW[shift:, shift, None], out=scratch_ND[shift:])
            out_ND[shift:].addcmul_(masked, self.weight_of(shift))
        return padded_ND

    def anti_causal(self, grad_ND: Tensor, padded_ND: Tensor | None, scratch_ND: Tensor) -> Tensor:
        """The transposed conv, ``dx[n] = sum_s w[W-1-s] g[n+s]`` over the taps n+s that read n from their own
        document, as a fresh ``[N, D]``. ``padded_ND``, if given, is ``g`` followed by W-1 spare rows."""
        tokens = self.tokens
        if self.fix_rows:
            if padded_ND is None:
                padded_ND = grad_ND.new_empty((tokens + self.width - 1, grad_ND.shape[1]))
                padded_ND[:tokens].copy_(grad_ND)
            padded_ND[tokens:].zero_()
            dx_ND = _conv2d(padded_ND, self.w_WD.flip(0), None, padding=0)  # valid conv, flipped kernel
            self._fix_rows(dx_ND, grad_ND, None, backwards=True)
            return dx_ND
        dx_ND = torch.mul(grad_ND, self.weight_of(0))
        for shift in range(1, self.width):
            kept = max(tokens - shift, 0)
            masked = torch.mul(grad_ND[shift:], self.same_NW[shift:, shift, None], out=scratch_ND[:kept])
            dx_ND[:kept].addcmul_(masked, self.weight_of(shift))
        return dx_ND

    def weight_grad(self, grad_ND: Tensor, x_ND: Tensor, scratch_ND: Tensor) -> Tensor:
        """dweight as ``[W, D]``: per tap, the products ``g[n] x[n-s]`` summed with their 0/1 same-document
        factors (one matrix-vector product), so the pairs that cross a start are zeros inside the sum."""
        product_ND = torch.mul(grad_ND, x_ND, out=scratch_ND)
        per_tap = [product_ND.sum(0)]
        for shift in range(1, self.width):
            product = torch.mul(grad_ND[shift:], x_ND[:-shift], out=scratch_ND[shift:])
            per_tap.append(torch.mv(product.t(), self.same_NW[shift:, shift]))
        return torch.stack(per_tap).flip(0)

    def _fix_rows(self, out_ND: Tensor, values_ND: Tensor, bias_D: Tensor | None, backwards: bool) -> None:
        """Recompute, from their masked taps, the rows of a blind conv that read across a start: the tokens whose
        farthest tap (``W-1`` back, or ``W-1`` ahead ``backwards``) is not in their document. The masks are
        monotone in the shift (a tap in the document means every nearer one is too), so that row set is exact."""
        if self.width == 1:
            return
        tokens, width = self.tokens, self.width
        shifts_W = torch.arange(width, device=out_ND.device)
        if backwards:
            # token n+s reads n from its own document: same[n+s, s] (0 past the last token)
            ahead_NW = F.pad(self.same_NW, (0, 0, 0, width - 1))
            src_NW = torch.arange(tokens, device=out_ND.device)[:, None] + shifts_W
            keep_NW = ahead_NW[src_NW, shifts_W]
        else:
            keep_NW = self.same_NW
        rows_n = (keep_NW[:, width - 1] == 0).nonzero()[:, 0]
        src_nW = rows_n[:, None] + (shifts_W if backwards else -shifts_W)
        taps_nWD = values_ND[src_nW.clamp(0, tokens - 1)] * keep_NW[rows_n][..., None]
        fixed_nD = (taps_nWD * self.w_WD.flip(0)).sum(1)  # w_WD.flip(0)[s] is the weight of tap s
        out_ND[rows_n] = fixed_nD if bias_D is None else fixed_nD + bias_D


def _conv2d(rows_ND: Tensor, w_WD: Tensor, bias_D: Tensor | None, padding: int) -> Tensor:
    """Boundary-blind depthwise conv along the rows of ``[L, D]`` (``out[j] = b + sum_i w[i] rows[j+i-padding]``,
    padded on both sides), as one NHWC ``conv2d``: ``[L + 2*padding - W + 1, D]`` rows."""
    dim, width = rows_ND.shape[1], w_WD.shape[0]
    nchw = rows_ND[None].permute(0, 2, 1).unsqueeze(2)  # [1, D, 1, L], strides of NHWC: what selects oneDNN's NHWC
    out = F.conv2d(nchw, w_WD.t().reshape(dim, 1, 1, width), bias_D, padding=(0, padding), groups=dim)
    # a view when the conv returned NHWC (oneDNN does for NHWC input), a copy otherwise (float64)
    return out.permute(0, 2, 3, 1).reshape(-1, dim).contiguous()


def _bias_of(bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if bias is None else bias.to(dtype)


def _channel_last(rows_ND: Tensor, like_BDT: Tensor) -> Tensor:
    """``[N, D]`` rows as the op's ``[B, D, T]`` layout: the transpose of a contiguous ``[B, T, D]``."""
    batch, dim, seqlen = like_BDT.shape
    return rows_ND.view(batch, seqlen, dim).transpose(1, 2)


def _rows(t_BDT: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B, D, T]`` as a contiguous ``[B*T, D]`` in ``dtype``: a free view for channel-last input.

    A ``[B, D, T]``-contiguous source is copied one row at a time: torch's 2-D transposing copy is blocked and
    ~5x faster on CPU than the generic strided copy that a 3-D copy takes."""
    batch, dim, seqlen = t_BDT.shape
    t_BTD = t_BDT.transpose(1, 2)
    if t_BTD.is_contiguous() and t_BDT.dtype == dtype:
        return t_BTD.view(batch * seqlen, dim)
    rows_BTD = t_BTD.new_empty(t_BTD.shape, dtype=dtype)
    if t_BDT.is_contiguous() and t_BDT.dtype == dtype:
        for row in range(batch):
            rows_BTD[row].copy_(t_BDT[row].t())
    else:
        rows_BTD.copy_(t_BTD)
    return rows_BTD.view(batch * seqlen, dim)
