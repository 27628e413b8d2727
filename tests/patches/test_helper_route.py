"""transformers 5.25 moved the kernel calls out of the layers' forwards into module-level helpers
(``causal_conv1d_forward``, ``mamba2_scan_forward``, ``mamba_scan_forward``): a ``Replacement`` names them in ``via``.
A layer that loads the helper instead of the kernel gets, for packed batches, a copy of the helper that calls
compilepack's replacement (its calls that drop ``**kwargs`` threaded) and, for any other batch, the stock helper as
it is bound. The stubs stand for both releases' layouts, and for a helper the `kernels` package turned into a module.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compilepack import IncompatibleTransformersError
from compilepack.ops.backends import Backends
from compilepack.patching import Family, Replacement
from compilepack.patching.builder import build_forwards, function_behind
from tests.patches import boundary_call_stubs as stubs

STUBS = stubs.__name__
SEQ_IDX = torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.int32)


def _packed_kernel(stock, backends, cp):
    def scan_kernel(hidden_states, seq_idx=None, **kwargs):
        if seq_idx is None:
            return stock(hidden_states)
        return {"compilepack": True, "seq_idx": seq_idx}

    return scan_kernel


SCAN = Replacement("scan_kernel", _packed_kernel, ("hidden_states",), via=("scan_forward",))


def _forward(layer: str, replacement: Replacement = SCAN):
    family = Family(f"stub_{layer.lower()}", STUBS, decoder="DropsKwargs", layers={layer: (replacement,)})
    return build_forwards(family, Backends())[getattr(stubs, layer)]


@pytest.mark.parametrize("layer", ["HelperLayer", "DirectLayer"])
def test_packed_batches_reach_the_replacement_through_the_helper_or_directly(layer):
    forward = _forward(layer)
    module = getattr(stubs, layer)()
    packed = forward(module, torch.zeros(1, 5), seq_idx=SEQ_IDX)
    assert packed["compilepack"] and packed["seq_idx"] is SEQ_IDX  # the helper's dropped kwargs threaded
    assert forward(module, torch.zeros(1, 5)) == {"stock": True, "seq_idx": None}  # a plain batch: stock


def test_a_plain_batch_calls_the_helper_as_it_is_bound_now(monkeypatch):
    """Not a copy: a helper rebound after patch() (the `kernels` package's kernelize, another patcher) is the one a
    plain batch runs."""
    forward = _forward("HelperLayer")
    monkeypatch.setattr(stubs, "scan_forward", lambda module, hidden_states, **kwargs: "rebound later")
    assert forward(stubs.HelperLayer(), torch.zeros(1, 5)) == "rebound later"


def test_without_via_a_layer_that_calls_a_helper_is_refused():
    """The control: the same replacement without ``via`` cannot reach the kernel, and says so."""
    direct_only = dataclasses.replace(SCAN, via=())
    with pytest.raises(IncompatibleTransformersError,
                       match=r"HelperLayer\.forward no longer loads the global scan_kernel"):
        _forward("HelperLayer", direct_only)


def test_the_helper_behind_a_kernels_module_is_found(monkeypatch):
    module = stubs.as_kernel_module(stubs.scan_forward)
    assert function_behind(module) is stubs.scan_forward
    assert function_behind(stubs.scan_forward) is stubs.scan_forward
    assert function_behind(torch.nn.Identity()) is None
    monkeypatch.setattr(stubs, "scan_forward", module)  # as transformers binds it where `kernels` is installed
    forward = _forward("HelperLayer")
    assert forward(stubs.HelperLayer(), torch.zeros(1, 5), seq_idx=SEQ_IDX)["compilepack"]
    assert forward(stubs.HelperLayer(), torch.zeros(1, 5))["stock"]
