"""``compilepack::lm_head_logprobs``: the LM head and its per-token log-probabilities, a chunk of tokens at a time.

A causal LM's loss needs, per token, the log-probability of its target under ``softmax(h @ W^T)``; the stock path
materialises the ``[N, V]`` logits, their fp32 copy and their gradient (3 x N x V x 4 bytes: 12 GB at 4,096 tokens
and a 248k vocabulary). This op computes the logits for ``chunk_tokens`` tokens at a time, keeps only per-token
statistics (``STATS``), and recomputes each chunk's logits in the backward: its extra memory is a few
``[chunk_tokens, V]`` tiles, independent of ``N``. As one custom op (with a fake and an explicit backward op) it is
one opaque node under ``torch.compile``: no graph break, no recompile as ``N`` changes.

- ``reference.py``: pure torch (any device), explicit backward;
- ``naive.py``: the whole ``[N, V]`` logits at once, the tests' oracle.

``compilepack.patching.chunked_head`` builds a causal LM's loss on it (HF ``Trainer``, hand loops) and
``compilepack.integrations.trl`` routes TRL's fused LM head to it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import backends
from .._scaffold import define_op
from . import reference
from .naive import lm_head_naive
from .reference import OPTIONAL, STATS

__all__ = ["STATS", "HeadStats", "default_chunk_tokens", "lm_head_logprobs", "lm_head_naive"]

# A chunk's logits tile holds about this many elements (fp32: 128 MiB); the forward keeps ~2 such tiles alive, the
# backward ~3. 135 tokens at Qwen3.5's 248,320-token vocabulary, capped at MAX_CHUNK_TOKENS for small vocabularies.
TILE_ELEMENTS = 1 << 25
MAX_CHUNK_TOKENS = 4096


class HeadStats(NamedTuple):
    """Per-token statistics of the next-token distribution, ``[N]`` each (fp32; fp64 for fp64 inputs); None when
    not asked for. ``log_probs``, ``entropy`` and ``log_z`` carry gradients, the others do not."""

    log_probs: Tensor  # log p(target); 0 where the target is ignore_index
    entropy: Tensor | None
    log_z: Tensor  # logsumexp of the (transformed) logits
    log_sum_sq_probs: Tensor | None  # log(sum_v p_v^2)
    mean_logits: Tensor | None
    is_top1: Tensor | None  # bool: the target is the (first) argmax


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk for a vocabulary: a tile of about ``TILE_ELEMENTS`` logits, at most ``MAX_CHUNK_TOKENS``."""
    return max(1, min(MAX_CHUNK_TOKENS, TILE_ELEMENTS // vocab_size))


def lm_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    stats: tuple[str, ...] = (),
    backend: str = backends.REFERENCE,
) -> HeadStats:
    """Per-token log-probabilities of ``targets`` under ``softmax(transform(hidden @ weight^T + bias))``, computed
    ``chunk_tokens`` tokens at a time: the ``[N, V]`` logits never exist.

    Examples::

        >>> h, w = torch.randn(300, 64, requires_grad=True), torch.randn(1000, 64, requires_grad=True)
        >>> targets = torch.randint(0, 1000, (300,))
        >>> out = lm_head_logprobs(h, w, None, targets, chunk_tokens=128, stats=("entropy",))
        >>> loss = -out.log_probs.sum() / (targets != -100).sum()      # = F.cross_entropy(h @ w.T, targets)
        >>> loss.backward()

    Args:
        hidden: ``[N, H]`` float, the tokens' last hidden states (already shifted against ``targets``).
        weight: ``[V, H]`` float, the LM head's weight. bias: ``[V]`` or None.
        targets: ``[N]`` integer class ids; ``ignore_index`` where a token has no target (its ``log_probs`` is 0
            and it gets no gradient through them).
        chunk_tokens: tokens per chunk; by default a tile of about ``TILE_ELEMENTS`` logits
            (:func:`default_chunk_tokens`). Results do not depend on it beyond rounding.
        logit_scale, softcap, temperature: ``z = softcap * tanh(logit_scale * y / softcap) / temperature`` (no
            tanh when ``softcap`` is None), as TRL's fused head and Gemma/Granite-style heads transform logits.
        stats: statistics to compute besides ``log_probs`` and ``log_z``: any of ``"entropy"``,
            ``"log_sum_sq_probs"``, ``"mean_logits"``, ``"is_top1"``.
        backend: only the pure-torch reference exists (it runs on any device).

    Returns:
        :class:`HeadStats`. The logits are computed in the autocast dtype under autocast (as the stock ``lm_head``
        is), else in the inputs' dtype; everything after them in fp32 (fp64 for fp64 inputs).
    """
    _check_arguments(hidden, weight, bias, targets, stats)
    chunk = default_chunk_tokens(weight.shape[0]) if chunk_tokens is None else chunk_tokens
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens}.")
    wanted = [name in stats for name in OPTIONAL]
    out, _ = OP(hidden, weight, bias, targets, ignore_index, chunk, compute_dtype(hidden, weight), float(logit_scale),
                float(softcap or 0.0), float(temperature), wanted, backend)
    rows = dict(zip(STATS, out.unbind(0)))
    picked = {name: (rows[name] if name in ("log_probs", "log_z") or name in stats else None) for name in STATS}
    if picked["is_top1"] is not None:
        picked["is_top1"] = picked["is_top1"] > 0.5
    return HeadStats(**picked)


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype of the logits tile: the autocast dtype under autocast (fp64 inputs excepted, as autocast leaves
    them alone), else the promoted dtype of the inputs."""
    device = hidden.device.type
    if hidden.dtype != torch.float64 and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _check_arguments(hidden, weight, bias, targets, stats) -> None:
    """Shape and dtype checks only (no tensor data), so they trace without a graph break."""
    unknown = sorted(set(stats) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"stats: unknown statistics {unknown}; expected some of {list(OPTIONAL)}.")
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float [N, H] tensor, got {hidden.dim()}-D {hidden.dtype}; flatten the "
                         "batch first (hidden.reshape(-1, hidden.shape[-1])).")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [V, H] tensor with H={hidden.shape[1]} (hidden.shape[1]); got "
                         f"{weight.dtype} of shape {tuple(weight.shape)}.")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be None or a [V] tensor with V={weight.shape[0]}; got {tuple(bias.shape)}.")
    if targets.shape != hidden.shape[:1] or targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer [N] tensor with N={hidden.shape[0]} (hidden.shape[0]); got "
                         f"{targets.dtype} of shape {tuple(targets.shape)}.")


def _signature(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int,
               chunk_tokens: int, compute_dtype: torch.dtype, logit_scale: float, softcap: float,
               temperature: float, stats: list[bool], backend: str): ...


OP = define_op(
    "compilepack::lm_head_logprobs",
    signature=_signature,
    differentiable=("hidden", "weight", "bias"),
    reference=reference.PATH,
    saves_output=True,  # log_z and the entropy rows: the backward's normaliser and entropy term
)
