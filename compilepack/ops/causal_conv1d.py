"""``compilepack::causal_conv1d_varlen``: depthwise causal conv1d that never reads across a document start.

The op takes the layout transformers passes to ``causal_conv1d_fn`` (``x [B, D, T]``, the transpose of a
``[B, T, D]`` projection) and returns the same channel-last layout: ``out`` is the transpose of a contiguous
``[B, T, D]`` tensor (strides ``(T*D, 1, D)``) on every path, which is what the causal-conv1d kernel returns
for channel-last input (``torch.empty_like(x)``) and what the caller's ``out.transpose(1, 2)`` wants.

Reference (any device, pure torch), in ``[B, T, D]`` (free for channel-last x):
  forward  = the boundary-blind conv over all B*T tokens as one row (W multiply-adds, or for large inputs
             one NHWC depthwise ``conv2d``: oneDNN's kernel on CPU), then the rows fewer than W-1 tokens
             after a document or row start (the only rows a tap can leak into) recomputed exactly from
             gathered, masked taps;
  backward = dx the same way (a valid conv with the flipped kernel, then the rows fewer than W-1 tokens
             before a document end recomputed), dweight as W dot products over tokens minus the few pairs
             that cross a start, dbias as a sum.
The silu activation is fused: its input (the conv output) is recomputed in the backward, as the CUDA kernel
does, so only the inputs are saved. The boundary rows are found with ``nonzero`` inside the op body (opaque
to the compiler; free on CPU, a sync on a CUDA device without causal-conv1d, where cuDNN's TF32 setting
also applies to the plain conv).

CUDA: causal-conv1d (read at v1.6.1, commit 0d2252d; the ``cpp_functions`` module exists since v1.5.1).
Forward ``causal_conv1d.causal_conv1d_fn(x, weight, bias, seq_idx=, activation=)``; backward the function its
``CausalConv1dFn.backward`` calls, ``causal_conv1d.cpp_functions.causal_conv1d_bwd_function``, so no forward is
re-run in Python. The kernel masks every tap by ``seq_idx`` equality, which for a non-decreasing row is
exactly "same document". It needs channel-last x (``stride(1) == 1``, ``stride(0)`` and ``stride(2)``
multiples of 8), ``D % 8 == 0``, ``2 <= W <= 4``, int32 contiguous ``seq_idx``; x is used as is when it is a
dense channel-last tensor (what transformers passes) and copied into one otherwise. Shapes the kernel
cannot take (``D % 8 != 0``, ``W > 4``, other dtypes) run the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compilepack import backends

ACTIVATIONS = (None, "silu", "swish")
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def causal_conv1d_varlen(x, weight, bias, seq_idx, activation=None, *, backend: str = "reference"):
    """Depthwise causal conv1d over packed rows: no tap reaches across a document start.

    Args:
        x: ``[B, D, T]`` float, any strides; transformers passes the transpose of a contiguous ``[B, T, D]``
            (channel-last), which is also the layout the CUDA kernel needs (other layouts are copied there).
        weight: ``[D, W]`` (transformers passes ``conv1d.weight.squeeze(1)``).
        bias: ``[D]`` or None.
        seq_idx: ``[B, T]`` integer (int32 from the HF collator), the document index of every token,
            non-decreasing along a row; a document starts where it changes and at the first token of each
            row, so rows are independent and ids may be global across rows. Moved to x's device if needed.
        activation: None, ``"silu"`` or ``"swish"`` (the same function), fused into forward and backward.
        backend: the CUDA library used when x is on CUDA (``"causal_conv1d"``) or ``"reference"``.

    Returns:
        ``[B, D, T]`` in x's dtype, channel-last: the transpose of a contiguous ``[B, T, D]``.
        Computed in float32 (or float64 for float64 weights), as the CUDA kernel accumulates.
    """
    _check_arguments(x, weight, bias, seq_idx, activation)
    silu = activation is not None
    return torch.ops.compilepack.causal_conv1d_varlen(x, weight, bias, seq_idx, silu, backend)


def _check_arguments(x, weight, bias, seq_idx, activation) -> None:
    """Shape and dtype checks only (no tensor data), so they trace without a graph break."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a float [B, D, T] tensor, got {x.dim()}-D {x.dtype} of shape {tuple(x.shape)}.")
    batch, dim, seqlen = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a float [D, W] tensor with D={dim} (x.shape[1]); got {weight.dtype} of shape "
            f"{tuple(weight.shape)}. Pass conv1d.weight.squeeze(1)."
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != dim or not bias.is_floating_point()):
        raise ValueError(f"bias must be None or a float [D] tensor with D={dim}; got {bias.dtype} {tuple(bias.shape)}.")
    if seq_idx.dim() != 2 or seq_idx.shape[0] != batch or seq_idx.shape[1] != seqlen:
        raise ValueError(
            f"seq_idx must have shape [B, T] = {(batch, seqlen)} (x.shape[0], x.shape[2]); got {tuple(seq_idx.shape)}."
        )
    if seq_idx.is_floating_point() or seq_idx.is_complex() or seq_idx.dtype == torch.bool:
        raise ValueError(f"seq_idx must be an integer tensor (int32 as the HF collator emits it), got {seq_idx.dtype}.")


# ----------------------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("compilepack::causal_conv1d_varlen", mutates_args=())
def _forward_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor,
    silu: bool,
    backend: str,
) -> torch.Tensor:
    if backends.use_kernel(x, backend) and _kernel_supports(x, weight):
        return _kernel_forward(x, weight, bias, seq_idx, silu)
    return reference_forward(x, weight, bias, seq_idx, silu)


@_forward_op.register_fake
def _forward_fake(x, weight, bias, seq_idx, silu, backend):
    return _channel_last_empty(x, x.dtype)


@torch.library.custom_op("compilepack::causal_conv1d_varlen_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor,
    silu: bool,
    weight_grads: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dx, dweight, dbias)``; dbias is zeros when bias is None (custom ops cannot return None).

    ``weight_grads=False`` (frozen conv, e.g. LoRA elsewhere) lets the reference skip dweight and dbias
    (zeros then); the kernel computes them in the same pass anyway.
    """
    if backends.use_kernel(x, backend) and _kernel_supports(x, weight):
        return _kernel_backward(grad_out, x, weight, bias, seq_idx, silu)
    return reference_backward(grad_out, x, weight, bias, seq_idx, silu, weight_grads)


@_backward_op.register_fake
def _backward_fake(grad_out, x, weight, bias, seq_idx, silu, weight_grads, backend):
    dbias = (bias if bias is not None else weight).new_empty((weight.shape[0],))
    return _channel_last_empty(x, x.dtype), weight.new_empty(weight.shape), dbias


def _setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, silu, backend = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx)
    ctx.silu, ctx.backend = silu, backend


def _backward(ctx, grad_out):
    x, weight, bias, seq_idx = ctx.saved_tensors
    weight_grads = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    dx, dweight, dbias = _backward_op(grad_out, x, weight, bias, seq_idx, ctx.silu, weight_grads, ctx.backend)
    return dx, dweight, (dbias if bias is not None else None), None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _channel_last_empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, D, T]`` as the transpose of a fresh contiguous ``[B, T, D]``: the op's one output layout."""
    batch, dim, seqlen = like.shape
    return like.new_empty((batch, seqlen, dim), dtype=dtype).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------
# reference (pure torch, exact on packed rows)


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    # accumulate in float32 at least, as the CUDA kernel does; float64 stays float64 (tests, gradcheck)
    return torch.promote_types(weight.dtype, torch.float32)


def reference_forward(x, weight, bias, seq_idx, silu: bool) -> torch.Tensor:
    """The op's forward in pure torch; returns ``[B, D, T]`` channel-last in x's dtype."""
    dtype = _compute_dtype(weight)
    x_BTD = _as_BTD(x, dtype)
    w_WD = weight.t().to(dtype).contiguous()  # contiguous rows for the boundary fix-ups
    bias_D = None if bias is None else bias.to(dtype)
    out_BTD, _ = _conv_BTD(x_BTD, w_WD, bias_D, seq_idx.to(x.device))
    if silu:
        out_BTD = F.silu(out_BTD, inplace=True)
    return out_BTD.to(x.dtype).transpose(1, 2)


def reference_backward(grad_out, x, weight, bias, seq_idx, silu: bool, weight_grads: bool = True):
    """``(dx, dweight, dbias)`` with explicit formulas; dx is channel-last like the forward output.
    Without ``weight_grads`` dweight and dbias are zeros (not computed)."""
    dtype = _compute_dtype(weight)
    x_BTD = _as_BTD(x, dtype)
    w_WD = weight.t().to(dtype).contiguous()
    seq_idx = seq_idx.to(x.device)
    batch, seqlen, dim = x_BTD.shape
    tokens, width = batch * seqlen, w_WD.shape[0]
    if silu:
        # silu's input (the conv output) is recomputed rather than saved, as the CUDA kernel does. Its
        # gradient overwrites it in place, and the buffer's W-1 spare rows become the zero padding the
        # transposed conv needs: no fresh [B, T, D] buffer (each costs page faults on CPU).
        pre_BTD, grad_padded_ND = _conv_BTD(x_BTD, w_WD, None if bias is None else bias.to(dtype), seq_idx)
        torch.ops.aten.silu_backward.grad_input(_as_BTD(grad_out, dtype), pre_BTD, grad_input=pre_BTD)
    else:
        grad_padded_ND = x_BTD.new_empty((tokens + width - 1, dim))
        _copy_into_BTD(grad_padded_ND[:tokens].view(batch, seqlen, dim), grad_out)
    grad_padded_ND[tokens:].zero_()
    grad_BTD = grad_padded_ND[:tokens].view(batch, seqlen, dim)
    dx_BTD = _conv_transpose_BTD(grad_padded_ND, grad_BTD, w_WD, seq_idx)
    dweight = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    dbias = (bias if bias is not None else weight).new_zeros(dim)
    if weight_grads:
        dweight.copy_(_weight_grad_WD(grad_BTD, x_BTD, seq_idx, width).t())
        if bias is not None:
            dbias.copy_(grad_BTD.sum((0, 1)))
    return dx_BTD.to(x.dtype).transpose(1, 2), dweight, dbias


def _as_BTD(t_BDT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, D, T]`` as a contiguous ``[B, T, D]`` in ``dtype``: a free view for channel-last input."""
    t_BTD = t_BDT.transpose(1, 2)
    if t_BTD.is_contiguous() and t_BDT.dtype == dtype:
        return t_BTD
    return _copy_into_BTD(t_BTD.new_empty(t_BTD.shape, dtype=dtype), t_BDT)


def _copy_into_BTD(dst_BTD: torch.Tensor, src_BDT: torch.Tensor) -> torch.Tensor:
    """Copy ``[B, D, T]`` into a contiguous ``[B, T, D]``.

    A ``[B, D, T]``-contiguous source goes one row at a time: torch's 2-D transposing copy is blocked and
    ~5x faster on CPU than the generic strided copy that a 3-D copy takes.
    """
    if src_BDT.is_contiguous() and src_BDT.dtype == dst_BTD.dtype:
        for row in range(src_BDT.shape[0]):
            dst_BTD[row].copy_(src_BDT[row].t())
        return dst_BTD
    return dst_BTD.copy_(src_BDT.transpose(1, 2))


def _conv_BTD(x_BTD, w_WD, bias_D, seq_idx):
    """Pre-activation output ``[B, T, D]`` (plain causal conv, then the rows after each start recomputed),
    and the ``[B*T + W-1, D]`` buffer it is the head of (its W-1 spare rows hold junk)."""
    batch, seqlen, dim = x_BTD.shape
    width = w_WD.shape[0]
    padded_ND = _plain_causal_conv(x_BTD.view(batch * seqlen, dim), w_WD, bias_D)
    out_BTD = padded_ND[: batch * seqlen].view(batch, seqlen, dim)
    if _sync_free(x_BTD):
        _subtract_crossing_taps(padded_ND[: batch * seqlen], x_BTD.view(-1, dim), w_WD, seq_idx, backwards=False)
        return out_BTD, padded_ND
    rows_b, rows_t = _rows_after_start(seq_idx, width)
    offsets_W = -torch.arange(width, device=x_BTD.device)
    taps_nWD = _gather_taps(x_BTD, seq_idx, rows_b, rows_t, offsets_W, keep_same=True)
    fixed_nD = (taps_nWD * w_WD.flip(0)).sum(1)
    if bias_D is not None:
        fixed_nD += bias_D
    out_BTD[rows_b, rows_t] = fixed_nD
    return out_BTD, padded_ND


def _conv_transpose_BTD(grad_padded_ND, grad_BTD, w_WD, seq_idx):
    """dx ``[B, T, D]``: plain transposed conv over ``grad_padded_ND`` (the gradient followed by W-1 zero
    rows), then the rows before each document end recomputed."""
    batch, seqlen, dim = grad_BTD.shape
    width = w_WD.shape[0]
    dx_BTD = _plain_anti_causal_conv(grad_padded_ND, w_WD).view(batch, seqlen, dim)
    if _sync_free(grad_BTD):
        _subtract_crossing_taps(dx_BTD.view(-1, dim), grad_BTD.reshape(-1, dim), w_WD, seq_idx, backwards=True)
        return dx_BTD
    rows_b, rows_t = _rows_before_end(seq_idx, width)
    offsets_W = torch.arange(width, device=grad_BTD.device)
    taps_nWD = _gather_taps(grad_BTD, seq_idx, rows_b, rows_t, offsets_W, keep_same=True)
    dx_BTD[rows_b, rows_t] = (taps_nWD * w_WD.flip(0)).sum(1)
    return dx_BTD


# From this many elements (B*T*D) on, the boundary-blind conv runs as one NHWC depthwise conv2d (oneDNN on
# CPU: ~2x the W multiply-adds at T=2048, D=1024). Below it, W multiply-adds: oneDNN opens an OpenMP region
# even for tiny inputs, which costs up to ~100x on a loaded 2-core machine, whereas elementwise ops under
# torch's grain size stay on one thread.
CONV2D_MIN_ELEMENTS = 1 << 19


def _plain_causal_conv(x_ND, w_WD, bias_D):
    """Boundary-blind causal conv of N tokens as one row, ``out[t] = b + sum_s w[W-1-s] * x[t-s]``, in rows
    ``[0, N)`` of a fresh ``[N + W-1, D]`` buffer (the spare rows hold junk). Taps that cross a row or
    document start are wrong here; the caller overwrites those rows."""
    tokens, dim = x_ND.shape
    width = w_WD.shape[0]
    if x_ND.numel() >= CONV2D_MIN_ELEMENTS:
        # [N, D] contiguous is the NHWC memory of [1, D, 1, N]
        kernel = w_WD.t().reshape(dim, 1, 1, width)
        out = F.conv2d(_as_nchw(x_ND), kernel, bias_D, padding=(0, width - 1), groups=dim)
        return _nhwc_rows(out)
    padded_ND = x_ND.new_empty((tokens + width - 1, dim))
    out_ND = padded_ND[:tokens]
    if bias_D is None:
        torch.mul(x_ND, w_WD[width - 1], out=out_ND)
    else:
        torch.addcmul(bias_D, x_ND, w_WD[width - 1], out=out_ND)
    for shift in range(1, min(width, tokens)):
        out_ND[shift:].addcmul_(x_ND[:-shift], w_WD[width - 1 - shift])
    return padded_ND


def _plain_anti_causal_conv(grad_padded_ND, w_WD):
    """``dx[t] = sum_s w[W-1-s] * grad[t+s]`` for the N = rows - (W-1) tokens of ``grad_padded_ND`` (whose
    last W-1 rows are zeros), boundary-blind, as a fresh ``[N, D]``."""
    rows, dim = grad_padded_ND.shape
    width = w_WD.shape[0]
    tokens = rows - (width - 1)
    if tokens * dim >= CONV2D_MIN_ELEMENTS:
        # a valid (unpadded) conv with the flipped kernel
        kernel = w_WD.flip(0).t().reshape(dim, 1, 1, width)
        return _nhwc_rows(F.conv2d(_as_nchw(grad_padded_ND), kernel, groups=dim))
    dx_ND = torch.mul(grad_padded_ND[:tokens], w_WD[width - 1])
    for shift in range(1, width):
        dx_ND.addcmul_(grad_padded_ND[shift : shift + tokens], w_WD[width - 1 - shift])
    return dx_ND


def _as_nchw(rows_ND: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` rows as the ``[1, D, 1, N]`` NHWC (channels-last) view a depthwise conv2d takes."""
    return rows_ND[None].permute(0, 2, 1).unsqueeze(2)  # strides (N*D, 1, N*D, D): what suggests NHWC


def _nhwc_rows(out_NCHW: torch.Tensor) -> torch.Tensor:
    """A depthwise conv2d output ``[1, D, 1, L]`` as ``[L, D]`` rows: a view when the conv returned NHWC
    (oneDNN and cuDNN do for NHWC input), a copy otherwise (float64 on CPU)."""
    return out_NCHW.permute(0, 2, 3, 1).reshape(-1, out_NCHW.shape[1]).contiguous()


def _weight_grad_WD(grad_BTD, x_BTD, seq_idx, width: int):
    """dweight as ``[W, D]``: W plain dot products over tokens, minus the few pairs that cross a start."""
    seqlen = x_BTD.shape[1]
    scratch_BTD = torch.empty_like(grad_BTD)  # one buffer for all W products: fresh buffers cost page faults
    per_shift = []
    for shift in range(width):
        if shift < seqlen:
            product = torch.mul(grad_BTD[:, shift:], x_BTD[:, : seqlen - shift], out=scratch_BTD[:, shift:])
            per_shift.append(product.sum((0, 1)))
        else:
            per_shift.append(x_BTD.new_zeros(x_BTD.shape[2]))
    if _sync_free(x_BTD):
        leaked_WD = _crossing_weight_grads(grad_BTD, x_BTD, seq_idx, width)
        return (torch.stack(per_shift) - leaked_WD).flip(0)
    rows_b, rows_t = _rows_after_start(seq_idx, width)
    offsets_W = -torch.arange(width, device=x_BTD.device)
    leaked_nWD = _gather_taps(x_BTD, seq_idx, rows_b, rows_t, offsets_W, keep_same=False)
    leaked_WD = (grad_BTD[rows_b, rows_t][:, None] * leaked_nWD).sum(0)
    return (torch.stack(per_shift) - leaked_WD).flip(0)


# Off the CPU (a CUDA device without causal-conv1d) the boundary rows are not looked up with ``nonzero``,
# which would be a device-to-host sync per call: every crossing tap is subtracted with a mask instead, W-1
# masked multiply-adds over all tokens. Exact, sync-free, about twice the plain conv.


def _sync_free(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _crosses_start(seq_idx, shift: int):
    """Flat ``[B*T]`` bool: the tap ``shift`` tokens back from each token is in another document or row."""
    crossing_BT = torch.ones_like(seq_idx, dtype=torch.bool)
    crossing_BT[:, shift:] = seq_idx[:, shift:] != seq_idx[:, :-shift]
    return crossing_BT.view(-1)


def _subtract_crossing_taps(out_ND, values_ND, w_WD, seq_idx, backwards: bool):
    """Remove from a boundary-blind (anti-)causal conv over the flat tokens every tap that crossed a start.

    Forward (``backwards=False``): ``out[n] -= w[W-1-s] * x[n-s]`` where token n's tap s crosses a start.
    Backward: ``dx[n] -= w[W-1-s] * g[n+s]`` where token n+s's tap s (which reads n) crosses a start."""
    tokens, width = out_ND.shape[0], w_WD.shape[0]
    for shift in range(1, min(width, tokens + 1)):
        crossing = _crosses_start(seq_idx, shift)[:, None].to(out_ND.dtype)
        weight = w_WD[width - 1 - shift]
        if backwards:
            out_ND[: tokens - shift] -= values_ND[shift:] * crossing[shift:] * weight
        else:
            out_ND[shift:] -= values_ND[:-shift] * crossing[shift:] * weight


def _crossing_weight_grads(grad_BTD, x_BTD, seq_idx, width: int):
    """``[W, D]`` (shift-major): the products ``g[n] * x[n-s]`` that the plain dot products wrongly include."""
    grad_ND, x_ND = grad_BTD.reshape(-1, grad_BTD.shape[2]), x_BTD.reshape(-1, x_BTD.shape[2])
    leaked = [x_ND.new_zeros(x_ND.shape[1])]
    for shift in range(1, width):
        if shift >= x_ND.shape[0]:
            leaked.append(x_ND.new_zeros(x_ND.shape[1]))
            continue
        crossing = _crosses_start(seq_idx, shift)[shift:, None].to(x_ND.dtype)
        # only taps inside a row are in the plain per-row dot products (shift < T)
        inside_row = _same_row(seq_idx, shift)[shift:, None].to(x_ND.dtype)
        leaked.append((grad_ND[shift:] * x_ND[:-shift] * crossing * inside_row).sum(0))
    return torch.stack(leaked)


def _same_row(seq_idx, shift: int):
    """Flat ``[B*T]`` bool: the token ``shift`` back is in the same row."""
    rows, seqlen = seq_idx.shape
    column = torch.arange(seqlen, device=seq_idx.device).expand(rows, seqlen)
    return (column >= shift).reshape(-1)


def _rows_after_start(seq_idx, width):
    """(batch, token) indices of the tokens fewer than W-1 positions after their document start."""
    reach, seqlen = width - 1, seq_idx.shape[1]
    inner = max(seqlen - reach, 0)
    near_BT = torch.zeros_like(seq_idx, dtype=torch.bool)
    near_BT[:, :reach] = True
    near_BT[:, seqlen - inner :] |= seq_idx[:, seqlen - inner :] != seq_idx[:, :inner]
    return near_BT.nonzero(as_tuple=True)


def _rows_before_end(seq_idx, width):
    """(batch, token) indices of the tokens fewer than W-1 positions before their document end."""
    reach, seqlen = width - 1, seq_idx.shape[1]
    inner = max(seqlen - reach, 0)
    near_BT = torch.zeros_like(seq_idx, dtype=torch.bool)
    near_BT[:, inner:] = True
    near_BT[:, :inner] |= seq_idx[:, :inner] != seq_idx[:, seqlen - inner :]
    return near_BT.nonzero(as_tuple=True)


def _gather_taps(values_BTD, seq_idx, rows_b, rows_t, offsets_W, keep_same: bool):
    """``[n, W, D]`` values at ``rows_t + offsets`` of each row, zeroed where that token is outside the row or
    (``keep_same``) in another document, or (not ``keep_same``) in the same document."""
    seqlen = values_BTD.shape[1]
    src_nW = rows_t[:, None] + offsets_W
    inside_nW = (src_nW >= 0) & (src_nW < seqlen)
    src_nW = src_nW.clamp(0, seqlen - 1)
    same_nW = seq_idx[rows_b[:, None], src_nW] == seq_idx[rows_b, rows_t][:, None]
    keep_nW = inside_nW & (same_nW if keep_same else ~same_nW)
    return values_BTD[rows_b[:, None], src_nW] * keep_nW[..., None].to(values_BTD.dtype)


# ----------------------------------------------------------------------------------------------------------
# CUDA kernel path (causal-conv1d)


def _kernel_supports(x, weight) -> bool:
    """Static shape/dtype facts the kernel needs; anything else runs the reference."""
    dim, width = weight.shape
    return (
        x.dtype in _KERNEL_DTYPES and weight.dtype in _KERNEL_DTYPES and dim % 8 == 0 and 2 <= width <= 4
    )


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dense channel-last ``[B, D, T]`` (the transpose of a contiguous ``[B, T, D]``).

    That layout satisfies every stride rule of the channel-last kernel (``stride(1) == 1``, ``stride(0)`` and
    ``stride(2)`` multiples of 8 since D is) and makes its ``empty_like`` outputs match the op's fake.
    """
    batch, dim, seqlen = t.shape
    if t.stride() == (seqlen * dim, 1, dim) and t.data_ptr() % 16 == 0:
        return t
    dense = torch.empty((batch, seqlen, dim), dtype=t.dtype, device=t.device)
    return dense.copy_(t.transpose(1, 2)).transpose(1, 2)


def _kernel_seq_idx(seq_idx, x):
    return seq_idx.to(device=x.device, dtype=torch.int32).contiguous()


def _kernel_bias(bias, weight):
    # the kernel wants bias in weight's dtype with unit stride
    return None if bias is None else bias.to(weight.dtype).contiguous()


def _kernel_forward(x, weight, bias, seq_idx, silu: bool) -> torch.Tensor:
    library = backends.load("causal_conv1d")
    return library.causal_conv1d_fn(
        _kernel_layout(x),
        weight,
        _kernel_bias(bias, weight),
        seq_idx=_kernel_seq_idx(seq_idx, x),
        activation="silu" if silu else None,
    )


def _kernel_backward(grad_out, x, weight, bias, seq_idx, silu: bool):
    library = backends.load("causal_conv1d.cpp_functions")
    kernel_bias = _kernel_bias(bias, weight)
    dx, dweight, dbias, _ = library.causal_conv1d_bwd_function(
        _kernel_layout(x),
        weight,
        kernel_bias,
        _kernel_layout(grad_out.to(x.dtype)),
        _kernel_seq_idx(seq_idx, x),
        None,  # initial_states: not allowed together with seq_idx
        None,  # dfinal_states
        None,  # dx: let the library allocate it (empty_like(x): channel-last)
        False,  # return_dinitial_states
        silu,
    )
    dbias = weight.new_zeros(weight.shape[0]) if bias is None else dbias.to(bias.dtype)
    return dx, dweight.contiguous(), dbias
