"""A call named in ``Family.boundary_calls`` is threaded only where the installed release drops ``**kwargs`` there:
one that forwards ``**kwargs`` receives the boundaries already (transformers 5.25 forwards them where 5.24 dropped
them, and one family declaration serves both), so it is left as it is. A call that passes a boundary keyword by
name cannot take them too (threading would give it twice: "got multiple values for keyword argument"), and a named
call the forward no longer makes is a declaration the release broke: ``patch()`` refuses both before changing
anything, naming the class and the call."""

from __future__ import annotations

import pytest
import torch

from compilepack import IncompatibleTransformersError
from compilepack.ops.backends import Backends
from compilepack.patching import Family, build_forwards
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


def test_a_call_that_already_forwards_kwargs_is_left_as_it_is():
    """It receives the boundaries through its own ``**kwargs``; threading it too would pass them twice."""
    family = Family("stub_forwarding", STUBS, decoder="DropsKwargs", layers={},
                    boundary_calls={"PassesKwargs": ("self.mixer",)})
    # threaded, this call would raise "multiple values"
    forward = build_forwards(family, Backends())[stubs.PassesKwargs]
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    received = forward(stubs.PassesKwargs(), torch.zeros(1, 5), cu_seq_lens_q=cu_seqlens, other=1)
    assert received == {"cu_seq_lens_q": cu_seqlens, "other": 1}


def test_a_call_that_passes_a_boundary_keyword_is_refused_at_patch_time():
    with pytest.raises(IncompatibleTransformersError, match=(
        rf"cannot pass the boundaries through {STUBS}\.PassesSeqIdx\.forward: its call self\.mixer\(\.\.\.\) is "
        r"named in the family's boundary_calls but already passes seq_idx=.*Remove 'self\.mixer' from boundary_calls"
    )):
        build_forwards(_family("PassesSeqIdx"), Backends())


def test_a_named_call_the_forward_no_longer_makes_is_refused_at_patch_time():
    family = Family("stub_gone", STUBS, decoder="DropsKwargs", layers={},
                    boundary_calls={"DropsKwargs": ("self.gone",)})
    with pytest.raises(IncompatibleTransformersError, match=r"DropsKwargs\.forward no longer calls self\.gone"):
        build_forwards(family, Backends())
