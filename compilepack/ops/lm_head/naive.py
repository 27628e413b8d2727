"""The LM head statistics from the whole ``[N, V]`` logits at once: slow on memory, obviously right, the tests'
oracle. Computes in the inputs' dtype (pass float64 for an exact answer); differentiable by autograd."""

from __future__ import annotations

import torch
from torch import Tensor


def lm_head_naive(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> dict[str, Tensor]:
    """Every statistic of :data:`compilepack.ops.lm_head.STATS` per token, as :func:`lm_head_logprobs` returns
    them (``log_probs`` 0 where the target is ``ignore_index``, ``is_top1`` a bool)."""
    z = torch.nn.functional.linear(hidden, weight, bias) * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    target = torch.where(valid, targets, 0).long()
    p = log_p.exp()
    return {
        "log_probs": torch.where(valid, log_p.gather(-1, target[:, None]).squeeze(-1), 0.0),
        "entropy": -(p * log_p).sum(-1),
        "log_z": torch.logsumexp(z, dim=-1),
        "log_sum_sq_probs": torch.logsumexp(2 * log_p, dim=-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == target,
    }
