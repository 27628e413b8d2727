"""Adapters to what users train with: collators (``collators``: boundaries for position-ids-only collators, moving
a batch while its boundaries stay on the host), TRL and HF Trainer (``trl``, ``trainer``), PEFT + gradient checkpointing compiled (``peft``)."""

from . import peft  # registers the guard of the input embeddings' requires_grad_ hook with patch()
from . import trl  # registers the routing of TRL's fused LM head with patch()
from .collators import add_boundaries, to_device, with_boundaries
from .trainer import Balance, ContextParallelTrainerMixin, attention_length_of, context_parallel

__all__ = [
    "Balance",
    "ContextParallelTrainerMixin",
    "add_boundaries",
    "attention_length_of",
    "context_parallel",
    "to_device",
    "with_boundaries",
]
