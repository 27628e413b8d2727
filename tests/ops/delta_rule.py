"""What the tests of the two delta-rule ops (gated delta rule, Kimi delta attention) share: both have one interface,
``varlen(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, scale, *, cu_seqlens_cpu, backend)``, and fla's chunk
functions behind their kernel paths, so the checks of that interface are written once here and each op's test file
calls them from its own tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tests.ops import contract
from tests.ops.fakes.fla import FakeFla
from tests.ops.oracle import OpChecks
from tests.strategies import cu_seqlens_of


@dataclasses.dataclass(frozen=True)
class DeltaRule:
    """One delta-rule op under test: its public function and custom op, how its tests draw the inputs
    (``make_inputs(total, batch=1, seed=0, ...)`` -> ``[q, k, v, g, beta]``), its :class:`OpChecks`, and the fla
    module its kernel path loads."""

    varlen: Callable
    op: object
    make_inputs: Callable
    checks: OpChecks
    fla_module: str


def assert_without_l2norm_and_custom_scale(rule: DeltaRule) -> None:
    """With ``use_qk_l2norm=False`` (q and k normalised by the caller) and a given or default scale, the op equals
    the oracle."""
    lengths = [40, 30]
    inputs = rule.make_inputs(sum(lengths), seed=5)
    q, k = (F.normalize(x.detach(), dim=-1).requires_grad_() for x in inputs[:2])
    for scale in (0.3, None):
        rule.checks.assert_equals_oracle([q, k, *inputs[2:]], cu_seqlens_of(lengths), use_qk_l2norm=False, scale=scale)


def assert_fla_path_equals_reference(rule: DeltaRule, fakes: dict, use_qk_l2norm: bool) -> None:
    """The fla path calls fla's functions in order (l2norm if asked, chunk indices built from the host copy of the
    boundaries, forward; then backward) and its output and gradients equal the reference path's."""
    lengths = [40, 1, 70]
    inputs = rule.make_inputs(sum(lengths), batch=1, seed=4)
    cu = cu_seqlens_of(lengths)
    fakes[rule.fla_module] = fake = FakeFla(sum(lengths))
    o, grads, _ = rule.checks.run(inputs, cu, use_qk_l2norm=use_qk_l2norm, backend="fla", cu_seqlens_cpu=cu.clone())
    forward = ["l2norm_fwd"] * 2 * use_qk_l2norm + ["prepare_chunk_indices", "fwd"]
    assert fake.calls == forward + ["prepare_chunk_indices", "bwd"] + ["l2norm_bwd"] * 2 * use_qk_l2norm
    assert all(torch.equal(host, cu) for host in fake.host_boundaries), "fla must get the host copy of cu_seqlens"
    o_ref, grads_ref, _ = rule.checks.run(inputs, cu, use_qk_l2norm=use_qk_l2norm, backend="reference")
    rule.checks.assert_all_close(o, grads, o_ref, grads_ref)


def fla_saved_shapes(rule: DeltaRule, fakes: dict, batch: int, length: int) -> list[tuple[int, ...]]:
    """The shapes of what the fla path saves for ``batch`` rows of one ``length``-token document each, once its
    forward and backward ops pass opcheck (so the fake's saved shapes match what fla returns)."""
    inputs = rule.make_inputs(length, batch=batch, seed=6)
    cu = cu_seqlens_of([length] * batch)
    fakes[rule.fla_module] = FakeFla(batch * length)
    args = (*inputs, cu, cu.clone(), True, inputs[0].shape[-1] ** -0.5, "fla")
    return [tuple(s.shape) for s in contract.opcheck_forward_and_backward(rule.op, args, [True] * 5)]


# The shape and dtype errors both ops raise alike; each op's table adds those of its own ``g``.
SHAPE_ERRORS = [
    (lambda a: a.update(q=a["q"][0]), "q must be 4-D"),
    (lambda a: a.update(k=a["k"][..., :-1]), "k must have q's shape"),
    (lambda a: a.update(v=a["v"][:, :-1]), "v must be [B, T, HV, V]"),
    (lambda a: a.update(beta=a["beta"][:, :-1]), "beta must be [B, T, HV]"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"].float()), "cu_seqlens must be a 1-D int32"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"][None]), "cu_seqlens must be a 1-D int32"),
    (lambda a: a.update(q=a["q"].long(), k=a["k"].long()), "q must be a float tensor"),
]


def assert_shape_error(rule: DeltaRule, change: Callable[[dict], None], message: str) -> None:
    """20 tokens of valid inputs, edited by ``change``, are refused with ``message``."""
    q, k, v, g, beta = (x.detach() for x in rule.make_inputs(20))
    args = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens_of([20]))
    contract.assert_refused(rule.varlen, args, change, message)
