"""``kimi_delta_attention_varlen`` under context parallelism, exactly as the gated delta rule (the delta rules'
shared split, ``_delta_rule/sharded.py``): its ``g`` is per channel of each value head, split with the heads under
Ulysses; over tokens the transform a slice applies to an incoming state is the product of ``(I - beta k k^T)
diag(exp g)``, carried by the same identity columns."""

from __future__ import annotations

import functools

from .._delta_rule.sharded import head_parallel, sharded
from . import kimi_delta_attention_varlen, kimi_delta_attention_varlen_state

kimi_delta_attention_head_parallel = functools.partial(head_parallel, kimi_delta_attention_varlen)
kimi_delta_attention_sharded = functools.partial(
    sharded, kimi_delta_attention_varlen, kimi_delta_attention_varlen_state
)
