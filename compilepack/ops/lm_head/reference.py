"""The chunked LM head's pure-torch path (any device): logits one chunk of tokens at a time, never ``[N, V]``.

For every chunk of ``C`` tokens the forward computes the logits tile ``[C, V]`` (in the compute dtype, as the
stock ``lm_head`` does under autocast), upcasts it to fp32, applies the logit transforms (scale, softcap,
temperature) and folds it into per-token statistics: ``log_z`` (the log-partition), the target's log-probability
and, when asked, the entropy and the other statistics of ``STATS``. Only those ``[N]`` rows are kept.

The backward recomputes each tile and turns it into the tile's logit gradient in place::

    dz_j = g_lz * p_j + g_lp * (1[j = target] - p_j) - g_H * p_j * (log p_j + H)

then chains it through the transforms and adds ``dz @ W`` into dhidden and ``dz^T @ h`` into dweight, in fp32 (as
TRL's chunked kernel accumulates: bf16 per-chunk products summed would bias training). Peak memory beyond the inputs
and the gradients: a few ``[C, V]`` fp32 tiles, whatever ``N`` is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._scaffold import Path

# The rows of the op's output, in order. The first three are differentiable.
STATS = ("log_probs", "entropy", "log_z", "log_sum_sq_probs", "mean_logits", "is_top1")
LOG_PROBS, ENTROPY, LOG_Z, LOG_SUM_SQ, MEAN_LOGITS, IS_TOP1 = range(len(STATS))
OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # log_probs and log_z: always computed


def forward(hidden, weight, bias, targets, ignore_index, chunk_tokens, compute_dtype, logit_scale, softcap,
            temperature, stats):
    """``out [len(STATS), N]`` fp32 (rows not asked for in ``stats`` stay zero); nothing else saved."""
    head = _Head(hidden, weight, bias, compute_dtype, logit_scale, softcap, temperature)
    wanted = dict(zip(OPTIONAL, stats))
    out = hidden.new_zeros((len(STATS), hidden.shape[0]), dtype=stat_dtype(compute_dtype))
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        z = head.logits(rows)  # [C, V] fp32, transformed
        target, valid = _targets(targets[rows], ignore_index)
        log_z = torch.logsumexp(z, dim=-1)
        out[LOG_Z, rows] = log_z
        out[LOG_PROBS, rows] = torch.where(valid, z.gather(-1, target[:, None]).squeeze(-1) - log_z, 0.0)
        if wanted["mean_logits"]:
            out[MEAN_LOGITS, rows] = z.mean(-1)
        if wanted["is_top1"]:
            out[IS_TOP1, rows] = (z.argmax(-1) == target).to(out.dtype)  # argmax: the first maximum, as TRL counts it
        if wanted["entropy"] or wanted["log_sum_sq_probs"]:
            p = z.sub(log_z[:, None]).exp_()  # [C, V] probabilities
            if wanted["entropy"]:
                out[ENTROPY, rows] = log_z - _rowdot(p, z)
            if wanted["log_sum_sq_probs"]:
                out[LOG_SUM_SQ, rows] = torch.log(_rowdot(p, p))
    return out, []


def fake(hidden, weight, bias, targets, ignore_index, chunk_tokens, compute_dtype, logit_scale, softcap,
         temperature, stats):
    return hidden.new_empty((len(STATS), hidden.shape[0]), dtype=stat_dtype(compute_dtype)), []


def backward(grad_out, out, saved, needs_grad, hidden, weight, bias, targets, ignore_index, chunk_tokens,
             compute_dtype, logit_scale, softcap, temperature, stats):
    """``(dhidden, dweight, dbias)`` in fp32, None where not needed (the scaffold casts to the inputs' dtypes)."""
    need_dh, need_dw, need_db = needs_grad
    head = _Head(hidden, weight, bias, compute_dtype, logit_scale, softcap, temperature)
    with_entropy = stats[0]
    dtype = stat_dtype(compute_dtype)
    weight32 = weight.to(dtype)
    grad = grad_out.to(dtype)
    dh = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_dw else None
    db = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_db else None
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        z, pre = head.logits(rows, keep_pre=True)
        target, valid = _targets(targets[rows], ignore_index)
        g_lp = torch.where(valid, grad[LOG_PROBS, rows], 0.0)
        # coefficient of p_j in dz_j: g_lz - g_lp - g_H * (log p_j + H); z becomes log p, then that coefficient
        log_p = z.sub_(out[LOG_Z, rows, None])
        coefficient = (grad[LOG_Z, rows] - g_lp)[:, None]
        p = log_p.exp()
        if with_entropy:
            log_p.add_(out[ENTROPY, rows, None]).mul_(-grad[ENTROPY, rows, None]).add_(coefficient)
            dz = p.mul_(log_p)
        else:
            dz = p.mul_(coefficient)
        dz.scatter_add_(-1, target[:, None], g_lp[:, None])
        del log_p
        head.chain(dz, pre)
        hidden32 = hidden[rows].to(dtype)
        if dh is not None:
            torch.mm(dz, weight32, out=dh[rows])
        if dw is not None:
            dw.addmm_(dz.t(), hidden32)
        if db is not None:
            db += dz.sum(0)
    return dh, dw, db


PATH = Path(forward=forward, backward=backward, fake=fake)


class _Head:
    """The logits of a chunk of tokens: ``h @ W^T + b`` in the compute dtype, then fp32 and the transforms
    ``z = softcap * tanh(scale * y / softcap) / temperature`` (softcap 0: none)."""

    def __init__(self, hidden, weight, bias, compute_dtype, logit_scale, softcap, temperature):
        self.hidden = hidden
        self.weight = weight.to(compute_dtype)  # once per call: autocast's cast of W, not one per chunk
        self.bias = None if bias is None else bias.to(compute_dtype)
        self.dtype, self.scale, self.softcap, self.inverse_t = compute_dtype, logit_scale, softcap, 1.0 / temperature

    def logits(self, rows: slice, keep_pre: bool = False):
        h = self.hidden[rows].to(self.dtype)
        y = torch.mm(h, self.weight.t()) if self.bias is None else torch.addmm(self.bias, h, self.weight.t())
        z = y.to(stat_dtype(self.dtype))  # no copy when the compute dtype is the statistics' own
        if self.scale != 1.0:
            z.mul_(self.scale)
        pre = None
        if self.softcap:
            z.div_(self.softcap).tanh_()
            pre = z.clone() if keep_pre else None  # tanh, for its derivative
            z.mul_(self.softcap)
        if self.inverse_t != 1.0:
            z.mul_(self.inverse_t)
        return (z, pre) if keep_pre else z

    def chain(self, dz: Tensor, tanh: Tensor | None) -> None:
        """``dz`` (the gradient of the transformed logits) becomes the gradient of ``h @ W^T + b``, in place."""
        factor = self.inverse_t * self.scale
        if tanh is not None:
            dz.mul_(tanh.square_().neg_().add_(1.0))
        if factor != 1.0:
            dz.mul_(factor)


def stat_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the statistics and gradients: fp32, or fp64 for an fp64 compute dtype (gradcheck)."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def _targets(targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(targets with ignored positions pointing at class 0, the mask of positions that are not ignored)."""
    valid = targets != ignore_index
    return torch.where(valid, targets, 0).long(), valid


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for ``[C, V]`` tensors without a ``[C, V]`` temporary."""
    return torch.bmm(a[:, None, :], b[:, :, None]).reshape(a.shape[0])
