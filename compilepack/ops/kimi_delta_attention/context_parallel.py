"""``kimi_delta_attention_varlen`` under context parallelism: head-parallel (Ulysses) over the whole rows, exactly
as the gated delta rule (its ``g`` is per channel of each value head, split with the heads)."""

from __future__ import annotations

import functools

from ..gated_delta_rule.context_parallel import head_parallel
from . import kimi_delta_attention_varlen

kimi_delta_attention_head_parallel = functools.partial(head_parallel, kimi_delta_attention_varlen)
