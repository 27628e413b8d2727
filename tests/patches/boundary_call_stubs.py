"""Stand-in modeling code for tests/patches/test_boundary_calls.py: forwards that call a mixer in the three ways
a call named in ``Family.boundary_calls`` can be written. Kept out of the test module because threading compiles
the module's source and checks it against the loaded code, which pytest's assertion rewriting would change."""

import torch


class Recorder(torch.nn.Module):
    """A mixer that returns the keyword arguments it received."""

    def forward(self, hidden_states, **kwargs):
        return kwargs


class DropsKwargs(torch.nn.Module):
    """Like Mamba2ForCausalLM: its forward takes **kwargs but calls the mixer without them (threading fixes it)."""

    def __init__(self):
        super().__init__()
        self.mixer = Recorder()

    def forward(self, hidden_states, **kwargs):
        return self.mixer(hidden_states)


class PassesKwargs(DropsKwargs):
    """Already forwards **kwargs: naming its call would pass every boundary kwarg twice."""

    def forward(self, hidden_states, **kwargs):
        return self.mixer(hidden_states, **kwargs)


class PassesSeqIdx(DropsKwargs):
    """Passes one boundary kwarg by name: threading would pass seq_idx twice."""

    def forward(self, hidden_states, seq_idx=None, **kwargs):
        return self.mixer(hidden_states, seq_idx=seq_idx)
