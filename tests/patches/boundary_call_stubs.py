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


# ------------------------------------------------------------------------------------------------ helper functions
# transformers 5.25 puts a module-level helper between a layer's forward and its kernel (``causal_conv1d_forward``
# calls ``causal_conv1d_fn``; ``mamba_scan_forward`` calls ``mamba_selective_scan`` without the kwargs it received).


def scan_kernel(hidden_states, seq_idx=None):
    """The stock kernel: records whether it saw boundaries."""
    return {"stock": True, "seq_idx": seq_idx}


def scan_forward(module, hidden_states, **kwargs):
    """A 5.25-style helper that drops its **kwargs on the way to the kernel."""
    return scan_kernel(hidden_states)


class HelperLayer(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        return scan_forward(self, hidden_states, **kwargs)


class DirectLayer(torch.nn.Module):
    """The same layer as a 5.24-style forward: the kernel called directly, with the kwargs."""

    def forward(self, hidden_states, **kwargs):
        return scan_kernel(hidden_states, **kwargs)


class KernelFuncModule(torch.nn.Module):
    """What the `kernels` package makes of a function decorated ``use_kernel_forward_from_hub``: a module whose
    class's forward calls the function it closes over."""


def as_kernel_module(func):
    class Func(KernelFuncModule):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()
