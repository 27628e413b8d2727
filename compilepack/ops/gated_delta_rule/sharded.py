"""``gated_delta_rule_varlen`` under context parallelism: the delta rules' shared split (``_delta_rule/sharded.py``:
head-parallel, over tokens through the state op, or both) bound to this rule's ops."""

from __future__ import annotations

import functools

from .._delta_rule.sharded import head_parallel, sharded
from . import gated_delta_rule_varlen, gated_delta_rule_varlen_state

gated_delta_rule_head_parallel = functools.partial(head_parallel, gated_delta_rule_varlen)
gated_delta_rule_sharded = functools.partial(sharded, gated_delta_rule_varlen, gated_delta_rule_varlen_state)
