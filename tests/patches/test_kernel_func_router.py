"""transformers 5.25 requires the `kernels` package, whose ``use_kernelized_func`` wraps each mixer and attention
layer's forward in a router that writes a context variable. Inside a gradient-checkpointed layer dynamo refuses that
write ("HOP: Unsafe side effect"): stock 5.25 breaks the graph there. compilepack's patched forwards leave the router
out (exact: a layer none of whose functions is kernelized routes nowhere else) and refuse kernelized layers."""

from __future__ import annotations

import pytest
import torch

import compilepack
from compilepack.errors import PatchConflictError
from compilepack.patching.rebind import is_kernel_func_router
from compilepack.patching import family_named
from tests.families import build_tiny
from tests.models import hf_batch, random_docs

LENGTHS = [9, 1, 70, 14]


def _routed_classes(model) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules() if is_kernel_func_router(type(m).forward)})


def _checkpointed(family: str):
    torch.manual_seed(0)
    model = build_tiny(family_named(family)).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, hf_batch(random_docs(model.config.vocab_size, LENGTHS, seed=1))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_checkpointed_patched_model_compiles_to_one_graph(family):
    model, batch = _checkpointed(family)
    report = compilepack.explain(compilepack.patch(model), batch, backward=True)
    assert (report.graphs, report.graph_breaks) == (1, 0), report.break_reasons


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_control_stock_breaks_on_the_router_under_checkpointing(family):
    """Where the router exists (transformers 5.25 with kernels), stock's checkpointed layers break on its write."""
    model, batch = _checkpointed(family)
    if not _routed_classes(model):
        pytest.skip("no kernels router on this transformers release (before 5.25)")
    plain = {key: batch[key] for key in ("input_ids", "labels")}  # stock refuses the hybrids' boundary kwargs on CPU
    report = compilepack.explain(model, plain, backward=True)
    assert report.graph_breaks >= 1 and any("side effect" in reason.lower() for reason in report.break_reasons)


def test_a_layer_with_kernelized_functions_is_refused():
    model = build_tiny(family_named("qwen3_5"))
    routed = [m for m in model.modules() if getattr(m, "_kernel_funcs", None)]
    if not routed:
        pytest.skip("no kernels function modules on this transformers release (before 5.25)")
    func = routed[0]._kernel_funcs["causal_conv1d_fn"]
    func.forward = lambda *args, **kwargs: None  # what kernels.kernelize sets on the instance
    with pytest.raises(PatchConflictError, match=r"causal_conv1d_fn are kernelized \(kernels\.kernelize\)"):
        compilepack.patch(model)
    assert compilepack.patching.patch_state(model) is None  # refused before changing anything
