"""Adapters to what users train with: TRL (``trl``: its fused LM heads routed), PEFT + gradient checkpointing
compiled (``peft``), the context-parallel HF / TRL trainer (``context_parallel_trainer``), and packed log-prob
passes for TRL's DPO and GRPO trainers (``rl_trainers``). The collator adapters
live with the batch contract (:mod:`compilepack.batch.collators`) and stay importable here."""

from . import peft  # registers the guard of the input embeddings' requires_grad_ hook with patch()
from . import trl  # registers the routing of TRL's fused LM head with patch()
from ..batch import add_boundaries, to_device, with_boundaries
from .context_parallel_trainer import Balance, ContextParallelTrainerMixin, attention_length_of, context_parallel
from .rl_trainers import PackedLogProbsMixin, boundary_kwargs, packed_logprobs
from .trl import with_routed_head

__all__ = [
    "Balance",
    "ContextParallelTrainerMixin",
    "PackedLogProbsMixin",
    "add_boundaries",
    "attention_length_of",
    "boundary_kwargs",
    "context_parallel",
    "packed_logprobs",
    "to_device",
    "with_boundaries",
    "with_routed_head",
]
