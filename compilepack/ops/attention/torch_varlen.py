"""Varlen attention on CUDA through torch's own varlen ops (``torch.ops.torch_attn._varlen_attn`` and
``_varlen_attn_backward``, registered by importing ``torch.nn.attention.varlen``).

The forward returns the output (q's shape), a float32 ``[H, T]`` log-sum-exp and an rng state; without dropout the
state is unused, so the backward is handed zeros.

The private ops change their parameters from release to release (read in each wheel's ``varlen.py``; docs/kernels.md):

| torch | forward | backward | kernel inside the op |
| --- | --- | --- | --- |
| 2.11 | 10 parameters, no ``enable_gqa`` | 14 | flash |
| 2.12, 2.13 | 14 (+ ``enable_gqa``, ``seqused_k``, ``block_table``, ``num_splits``) | 14 | flash |
| 2.14 | 14 | 14 | cuDNN when it can (SM90/SM100, equal heads, ``max_q > 128``, 16-bit, window ``[-1, -1]``) |
| 2.15 | 15 (+ ``backend``) | 15 (+ ``backend``) | the ``backend`` passed (default flash) |

So each call passes the query, keys, values, boundaries and bounds positionally (the same seven in every release)
and the rest by name, reading the installed op's schema: ``enable_gqa`` where the op has it (flash takes grouped
heads natively where it does not), ``backend=FLASH`` where the op has it. Causal attention always goes as
``is_causal`` with the window ``[-1, 0]``, as torch's public ``varlen_attn`` calls it: flash computes the same
either way, and torch 2.14's op then never picks cuDNN, whose causal mask is aligned to the top left of each
document (torch 2.15's own comment): wrong for ``varlen_attention_kv``, whose queries are the tail of longer key
documents. Every call therefore runs flash-attn 2's kernels (``flash_api.cpp``), or cuDNN only for non-causal
attention on 2.14, where alignment does not matter.

flash-attn 2 has a one-token-per-sequence shortcut at ``max_seqlen_q == 1`` that fails on empty sequences; the
kernels are handed a bound of at least 2, as in ``flash_attn.py``.
"""

from __future__ import annotations

import torch

from .. import backends
from .._scaffold import Path
from .flash_attn import kernel_max_seqlen, refuse_more_queries_than_keys
from .reference import NO_WINDOW

TORCH_VARLEN_MODULE = "torch.nn.attention.varlen"


# the parameters a release's op may lack, and what leaving each out means there (anything else missing is refused)
_OPTIONAL = {
    "enable_gqa": "flash-attn 2's kernels take grouped heads as they come (torch 2.11)",
    "backend": "the op has no backend choice (before torch 2.15)",
}


def _window(causal: bool, window_left: int) -> tuple[bool, list[int]]:
    """(is_causal, window) for torch's op: causal attention as is_causal with a (left, 0) window (left -1: none), so
    that no release's op picks cuDNN for it; bidirectional attention as a (w, w) window, (-1, -1) for none."""
    if causal and window_left == NO_WINDOW:
        return True, [-1, 0]
    return False, [window_left, 0 if causal else window_left]


def _call(name: str, *tensors, **options):
    """torch's op ``name`` with the seven leading arguments every release takes positionally and ``options`` by name,
    each passed only where the installed op has it (``_OPTIONAL``); a missing one that matters is refused."""
    backends.load(TORCH_VARLEN_MODULE)  # registers torch.ops.torch_attn
    op = getattr(torch.ops.torch_attn, name)
    accepted = _parameters(op)
    missing = sorted(set(options) - accepted - set(_OPTIONAL))
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__}'s torch.ops.torch_attn.{name} takes no {missing}, which compilepack passes "
            "(a release it was not written against). Run without it: compilepack.patch(model, "
            "backend={'attention': 'reference'}), or install a torch listed in docs/kernels.md."
        )
    if "backend" in accepted:
        options["backend"] = _flash_backend()
    return op(*tensors, **{key: value for key, value in options.items() if key in accepted})


def _parameters(op) -> frozenset[str]:
    return frozenset(argument.name for argument in op.default._schema.arguments)


def _flash_backend() -> int:
    """torch 2.15's ``backend`` value for flash attention (``torch.nn.attention.varlen._FLASH_ATTENTION_BACKEND``)."""
    return torch.nn.attention.SDPBackend.FLASH_ATTENTION.value


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left):
    is_causal, window = _window(causal, window_left)
    out, lse, _ = _call(
        "_varlen_attn", q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q, cu_seqlens_k,
        kernel_max_seqlen(max_seqlen_q), kernel_max_seqlen(max_seqlen_k), is_causal=is_causal, scale=scale,
        window_size=window, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out, [lse]


def _backward(grad_out, out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
              window_left):
    is_causal, window = _window(causal, window_left)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
    dq, dk, dv = _call(
        "_varlen_attn_backward", grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out, lse,
        cu_seqlens_q, cu_seqlens_k, kernel_max_seqlen(max_seqlen_q), kernel_max_seqlen(max_seqlen_k),
        is_causal=is_causal, rng_state=rng_state, scale=scale, window_size=window,
    )
    return dq, dk, dv


def forward(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale, window_left):
    return _forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal, scale, window_left)


def fake(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale, window_left):
    total, heads = q.shape[:2]
    return q.new_empty(total, heads, v.shape[2]), [q.new_empty(heads, total, dtype=torch.float32)]


def backward(grad_out, out, saved, needs_grad, q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, causal, scale,
             window_left):
    (lse,) = saved
    return _backward(grad_out, out, lse, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal, scale,
                     window_left)


PATH = Path(forward=forward, backward=backward, fake=fake)


# ------------------------------------------------------------------------------------------------ keys beyond queries
#
# ``compilepack::varlen_attention_kv`` on torch's varlen ops, separate query and key boundaries (flash-attn's
# bottom-right causal alignment, as in ``flash_attn.py``; never cuDNN's top-left one, see the module docstring).


def forward_kv(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k,
               causal, scale, window_left):
    refuse_more_queries_than_keys(cu_seqlens_q_cpu, cu_seqlens_k_cpu)
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left)


def fake_kv(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k,
            causal, scale, window_left):
    return fake(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, max_seqlen_q, causal, scale, window_left)


def backward_kv(grad_out, out, saved, needs_grad, q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k,
                cu_seqlens_k_cpu, max_seqlen_q, max_seqlen_k, causal, scale, window_left):
    (lse,) = saved
    return _backward(grad_out, out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     scale, window_left)


PATH_KV = Path(forward=forward_kv, backward=backward_kv, fake=fake_kv)
