"""``compilepack::varlen_attention``: attention over packed documents, each attending only to itself.

Layout follows flash-attn's varlen functions: tokens of all documents are concatenated along dim 0.

- ``q``: ``[T, H, D]``; ``k``: ``[T, Hkv, D]``; ``v``: ``[T, Hkv, Dv]`` with ``H`` a multiple of ``Hkv`` (GQA);
  ``Dv`` may differ from ``D`` (MLA): the public function pads to one head dim, exactly
- ``cu_seqlens``: ``int32 [N+1]``, document ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``
- ``max_seqlen``: Python int, an upper bound of the longest document (the row length is always safe)
- returns ``[T, H, Dv]``

The forward also returns the log-sum-exp ``[H, T]`` (saved for the explicit backward, with the output).

- ``reference.py``: one attention call per document (the CPU flash kernel on CPU, explicit math elsewhere), in
  float32 or float64, explicit backward; what runs on CPU;
- ``flash_attn.py``: flash-attn 2's varlen kernels (CUDA, ``backend="flash_attn"``);
- ``torch_varlen.py``: torch's own ``torch.ops.torch_attn._varlen_attn`` (CUDA, ``backend="torch_varlen"``);
- ``naive.py``: explicit masked softmax per document, the tests' oracle.

``compilepack::varlen_attention_kv``: each document's queries attend its keys from separate boundaries
(``cu_seqlens_q``, ``cu_seqlens_k``, flash-attn's varlen convention, causal aligned at the bottom right): what context
parallelism over tokens needs (a rank's queries against the gathered keys, ``sharded.py``); on CUDA the same
kernels as ``varlen_attention`` with separate q / k boundaries (``PATH_KV`` in ``flash_attn.py``, ``torch_varlen.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import backends
from .._scaffold import define_op
from . import flash_attn, reference, torch_varlen
from .naive import attention_naive
from .reference import NO_WINDOW

__all__ = ["NO_WINDOW", "attention_naive", "varlen_attention", "varlen_attention_kv"]


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, causal: bool = True,
    scale: float | None = None, window: int | None = None, *, cu_seqlens_cpu: Tensor | None = None,
    backend: str = backends.REFERENCE,
) -> Tensor:
    """Attention of every packed document with itself only.

    Args:
        q: ``[T, H, D]`` queries of all documents, concatenated.
        k: ``[T, Hkv, D]`` keys; ``H % Hkv == 0`` (grouped-query attention).
        v: ``[T, Hkv, Dv]`` values.
        cu_seqlens: ``int32 [N+1]`` document boundaries (0, ..., T); zero-length documents are allowed.
        max_seqlen: Python int upper bound of the longest document; a larger value gives identical results.
        causal: causal attention inside each document.
        scale: softmax scale, default ``D ** -0.5``.
        window: sliding window as transformers counts it (a query sees itself and ``window - 1`` earlier
            tokens), or None for full attention.
        cu_seqlens_cpu: the same boundaries on the host, if at hand: the reference path loops over documents with
            Python ints and reads them there instead of copying ``cu_seqlens`` back from the device.
        backend: CUDA library used when the tensors are on CUDA (``flash_attn``, ``torch_varlen``,
            ``reference``); chosen once by ``compilepack.patch``.

    Returns:
        ``[T, H, Dv]`` in q's dtype (the reference computes in float32, or float64 for float64 inputs).
    """
    _check_inputs(q, k, v, cu_seqlens, cu_seqlens_cpu)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    window_left = NO_WINDOW if window is None else int(window) - 1
    q, k, v, value_dim = _common_head_dim(q, k, v)
    out, _lse = OP(q, k, v, cu_seqlens, cu_seqlens_cpu, max_seqlen, bool(causal), scale, window_left, backend)
    return out[..., :value_dim]


def _common_head_dim(q, k, v):
    """Zero-pad q/k or v to one head dim (MLA: values narrower than queries). The flash kernels (CPU, flash-attn
    2, torch varlen) take a single head dim; zero query/key columns add nothing to the scores and zero value
    columns only produce output columns that are cut off, so the result and its gradients are exact."""
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    if value_dim < head_dim:
        v = torch.nn.functional.pad(v, (0, head_dim - value_dim))
    elif head_dim < value_dim:
        q, k = (torch.nn.functional.pad(x, (0, value_dim - head_dim)) for x in (q, k))
    return q, k, v, value_dim


def _check_inputs(q, k, v, cu_seqlens, cu_seqlens_cpu) -> None:
    """Shape/dtype errors a caller can fix, raised before any compute (static facts only, safe to trace)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention expects q, k, v as [T, heads, head_dim]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}. Flatten the batch: x.reshape(-1, heads, head_dim)."
        )
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"varlen_attention: query heads ({q.shape[1]}) must be a multiple of key/value heads "
            f"(k {k.shape[1]}, v {v.shape[1]})."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"varlen_attention: cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}; use cu_seqlens.to(torch.int32)."
        )
    if cu_seqlens_cpu is not None and (cu_seqlens_cpu.dim() != 1 or cu_seqlens_cpu.device.type != "cpu"):
        raise ValueError(
            f"varlen_attention: cu_seqlens_cpu must be the host copy of cu_seqlens (1-D, on the CPU), got "
            f"{tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}."
        )


def _signature(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None, max_seqlen: int,
    causal: bool, scale: float, window_left: int, backend: str,
): ...


OP = define_op(
    "compilepack::varlen_attention",
    signature=_signature,
    differentiable=("q", "k", "v"),
    reference=reference.PATH,
    kernels={"flash_attn": flash_attn.PATH, "torch_varlen": torch_varlen.PATH},
    saves_output=True,  # every backward (flash kernels, reference) reads the forward's output
    boundaries=("cu_seqlens", "cu_seqlens_cpu"),
    kind="attention",
)


def varlen_attention_kv(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool = True, scale: float | None = None, window: int | None = None, *,
    cu_seqlens_q_cpu: Tensor | None = None, cu_seqlens_k_cpu: Tensor | None = None, backend: str = backends.REFERENCE,
) -> Tensor:
    """Attention of each document's queries to its keys, with separate boundaries for queries and keys (flash-attn's
    ``flash_attn_varlen_func`` convention): document ``i`` has queries ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` and
    keys/values ``k, v[cu_seqlens_k[i]:cu_seqlens_k[i+1]]``; with ``causal`` the queries are the *last* ``Lq`` of the
    document's ``Lk`` positions (the mask aligned at the bottom right), so ``Lq <= Lk``.

    Args as :func:`varlen_attention`, with ``k``/``v`` ``[Tk, Hkv, D]``, ``cu_seqlens_q``/``cu_seqlens_k`` ``int32
    [N+1]`` (the same N documents; empty ones allowed) and their host copies.

    Example::

        q = torch.randn(5, 4, 16); k, v = torch.randn(2, 9, 2, 16).unbind(0)
        cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)    # two documents: 2 and 3 queries
        cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)    # ... their last 2 of 4 and 3 of 5 keys
        out = varlen_attention_kv(q, k, v, cu_q, cu_k, 3, 5)  # [5, 4, 16]
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu)
    _check_inputs(q, k, v, cu_seqlens_k, cu_seqlens_k_cpu)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    window_left = NO_WINDOW if window is None else int(window) - 1
    q, k, v, value_dim = _common_head_dim(q, k, v)
    out, _lse = OP_KV(q, k, v, cu_seqlens_q, cu_seqlens_q_cpu, cu_seqlens_k, cu_seqlens_k_cpu, max_seqlen_q,
                      max_seqlen_k, bool(causal), scale, window_left, backend)
    return out[..., :value_dim]


def _kv_signature(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_q_cpu: Tensor | None, cu_seqlens_k: Tensor,
    cu_seqlens_k_cpu: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
    window_left: int, backend: str,
): ...


OP_KV = define_op(
    "compilepack::varlen_attention_kv",
    signature=_kv_signature,
    differentiable=("q", "k", "v"),
    reference=reference.PATH_KV,
    kernels={"flash_attn": flash_attn.PATH_KV, "torch_varlen": torch_varlen.PATH_KV},
    saves_output=True,
    boundaries=("cu_seqlens_q", "cu_seqlens_q_cpu", "cu_seqlens_k", "cu_seqlens_k_cpu"),
    follows="varlen_attention",  # the gathered keys of context parallelism: the attention's own choice
)
