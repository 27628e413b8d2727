"""The delta rules under context parallelism: head-parallel (Ulysses) over the whole rows.

Value heads (with their ``g`` and ``beta``) are split in W slices between two all-to-alls; query/key heads split
alike when W divides them, else each rank receives the one q/k head its value heads read (``num_k_heads <=
num_v_heads``). Shared by the gated delta rule and Kimi delta attention (``head_parallel`` takes the op).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor

from ...distributed.collectives import gather_heads, head_split, split_heads, split_read_heads
from . import gated_delta_rule_varlen


def head_parallel(
    varlen: Callable, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, *, cp,
    where: str, **op_kwargs,
) -> Tensor:
    """A delta-rule op ``varlen`` on a token shard (``[R, T_local, heads, ...]``) with the global ``cu_seqlens``:
    each rank runs ``HV / W`` value heads (their ``g``, ``beta``) and the q/k heads they read, over the whole
    rows."""
    per_rank = head_split(v.shape[2], q.shape[2], cp.size, where, "linear_num_value_heads", "linear_num_key_heads")
    q, k = (split_read_heads(x, cp, per_rank) for x in (q, k))
    v, g, beta = (split_heads(x, cp) for x in (v, g, beta))
    return gather_heads(varlen(q, k, v, g, beta, cu_seqlens, **op_kwargs), cp)


gated_delta_rule_head_parallel = functools.partial(head_parallel, gated_delta_rule_varlen)
