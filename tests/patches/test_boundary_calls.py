"""A call named in ``Family.boundary_calls`` must not already pass ``**kwargs`` (or a boundary keyword): threading
appends the boundary kwargs to it, which would give them twice and fail at run time with "got multiple values for
keyword argument". ``patch()`` refuses such a family before changing anything, naming the class and the call."""

from __future__ import annotations

import pytest
import torch

from compilepack import IncompatibleTransformersError
from compilepack.backends import Backends
from compilepack.patching import Family
from compilepack.patching.rebind import install, with_globals
from tests.patches import boundary_call_stubs as stubs

STUBS = stubs.__name__


def _family(class_name: str) -> Family:
    return Family(f"stub_{class_name.lower()}", STUBS, decoder=class_name, layers={},
                  boundary_calls={class_name: ("self.mixer",)})


def test_a_call_that_drops_kwargs_is_threaded():
    """The control: the call that drops **kwargs is accepted and then receives the batch's boundaries."""
    install(stubs, "test", {})  # the helper threaded calls read (patch() installs it with the replacements)
    forward = with_globals(stubs.DropsKwargs.forward, {}, ("self.mixer",))
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    received = forward(stubs.DropsKwargs(), torch.zeros(1, 5), cu_seq_lens_q=cu_seqlens, other=1)
    assert received == {"cu_seq_lens_q": cu_seqlens}


@pytest.mark.parametrize("class_name, passed", [("PassesKwargs", r"\*\*kwargs"), ("PassesSeqIdx", "seq_idx=")])
def test_a_call_that_already_passes_boundaries_is_refused_at_patch_time(class_name, passed):
    with pytest.raises(IncompatibleTransformersError, match=(
        rf"cannot pass the boundaries through {STUBS}\.{class_name}\.forward: its call self\.mixer\(\.\.\.\) is "
        rf"named in the family's boundary_calls but already passes {passed}.*Remove 'self\.mixer' from boundary_calls"
    )):
        _family(class_name).forwards(Backends())
