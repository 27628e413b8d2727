"""What the two delta rules (``gated_delta_rule/``, ``kimi_delta_attention/``) share: their ops' declarations, input
checks and calls, with and without a state (``reference.py``: the reference's paths around each rule's chunks;
``fla.py``: the glue around fla's kernels; ``sharded.py``: both under context parallelism). Each rule's folder holds
only what is its own: its reference chunks, its calls into fla, its oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._scaffold import Op, Path, define_op


def check_delta_rule_inputs(q, k, v, g, beta, cu_seqlens, per_channel_decay: bool) -> None:
    """Shape and dtype checks of a delta-rule op's inputs (``g`` is ``[B, T, HV]``, or ``[B, T, HV, K]`` with a
    per-channel decay). Nothing here reads tensor data, so it traces without guards on values."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, heads, head_dim], got shape {tuple(x.shape)}.")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [B, T, H, K], got {tuple(k.shape)}.")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T = {tuple(q.shape[:2])}, got {tuple(v.shape)}.")
    if v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"v's head count HV={v.shape[2]} must be a multiple of q's H={q.shape[2]}.")
    g_shape, g_text = (v.shape[:3], "[B, T, HV]")
    if per_channel_decay:
        g_shape, g_text = (*v.shape[:3], q.shape[3]), "[B, T, HV, K]"
    if g.shape != g_shape:
        raise ValueError(f"g must be {g_text} = {tuple(g_shape)}, got {tuple(g.shape)}.")
    if beta.shape != v.shape[:3]:
        raise ValueError(f"beta must be [B, T, HV] = {tuple(v.shape[:3])}, got {tuple(beta.shape)}.")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {x.dtype}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor [N+1], got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}."
        )


def _signature(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None,
    use_qk_l2norm: bool, scale: float, backend: str,
): ...


def define_delta_rule_op(name: str, reference: Path, fla: Path, fla_applies=None) -> Op:
    """The custom op of a delta rule: inputs ``q, k, v, g, beta`` (differentiable), the boundaries, the l2norm
    flag and the scale; the reference path, and fla's kernels on CUDA (where ``fla_applies``, if given)."""
    return define_op(
        name, signature=_signature, differentiable=("q", "k", "v", "g", "beta"), reference=reference,
        kernels={"fla": fla}, kernel_applies=fla_applies, boundaries=("cu_seqlens", "cu_seqlens_cpu"),
        kind="delta_rule",
    )


def run_delta_rule(
    op: Op, q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, cu_seqlens_cpu, backend, per_channel_decay: bool
) -> Tensor:
    """A public delta-rule function's body: check the inputs, default the scale to ``K ** -0.5``, run ``op``."""
    check_delta_rule_inputs(q, k, v, g, beta, cu_seqlens, per_channel_decay)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    o, _ = op(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, bool(use_qk_l2norm), scale, backend)
    return o


def define_delta_rule_state_op(name: str, reference: Path, fla: Path, fla_applies=None) -> Op:
    """The ``*_varlen_state`` op of a delta rule: :func:`define_delta_rule_op`'s inputs with ``initial_state`` (also
    differentiable), returning ``(out, final_state, saved)``."""
    return define_op(
        name, signature=_state_signature, outputs=("out", "final_state"),
        differentiable=("q", "k", "v", "g", "beta", "initial_state"), reference=reference, kernels={"fla": fla},
        kernel_applies=fla_applies, boundaries=("cu_seqlens", "cu_seqlens_cpu"),
        follows=name.removeprefix("compilepack::").removesuffix("_state"),  # the state pass: the op's own choice
    )


def _state_signature(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None,
    initial_state: Tensor, use_qk_l2norm: bool, scale: float, backend: str,
): ...


def run_delta_rule_state(
    op: Op, q, k, v, g, beta, cu_seqlens, initial_state, use_qk_l2norm, scale, cu_seqlens_cpu, backend,
    per_channel_decay: bool,
) -> tuple[Tensor, Tensor]:
    """A public delta-rule state function's body: check the inputs and the initial state's shape, default the scale,
    run the state op ``op``: ``(o, final_state)``."""
    check_delta_rule_inputs(q, k, v, g, beta, cu_seqlens, per_channel_decay)
    rows, _, value_heads, value_dim = v.shape
    state_shape = (rows, value_heads, q.shape[3], value_dim)
    if initial_state.shape != state_shape:
        raise ValueError(f"initial_state must be [B, HV, K, V] = {state_shape}, got {tuple(initial_state.shape)}.")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    o, final, _ = op(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, bool(use_qk_l2norm), scale, backend)
    return o, final
