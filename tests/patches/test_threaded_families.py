"""The families whose stacks drop ``**kwargs`` on the way to a mixer (``Family.boundary_calls``): Mamba,
FalconMamba and Jamba (Mamba1 scans), Mamba2 (its CausalLM wrapper).

In transformers 5.24 ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` call their backbone, ``MambaModel`` each block, and
``MambaBlock`` / ``JambaMambaDecoderLayer`` the mixer without ``**kwargs``, and every Mamba1 mixer calls
``mamba_selective_scan`` (and ``mamba_inner_fn``) without them. The first test pins that fact: if a transformers
release starts passing them, the threading becomes redundant (and a threaded call that also passes ``**kwargs``
would receive the keys twice). The others prove the boundaries travel as arguments, not as state.
"""

from __future__ import annotations

import pytest
import torch

import compilepack
from compilepack.patching import family_named
from tests.families import available_families, build_tiny
from tests.models import hf_batch, random_docs, relative_grad_error, summed_token_loss

MIXERS = {"mamba": "MambaMixer", "falcon_mamba": "FalconMambaMixer", "jamba": "JambaMambaMixer"}
THREADED = [pytest.param(f, id=f.name) for f in available_families() if f.boundary_calls]
LENGTHS = [70, 1, 23, 5]


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_transformers_drops_the_boundaries_before_the_mixer(name):
    torch.manual_seed(0)
    model = build_tiny(family_named(name)).eval()
    seen = []
    for layer in model.modules():
        if type(layer).__name__ == MIXERS[name]:
            layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(**hf_batch(random_docs(model.config.vocab_size, LENGTHS)), use_cache=False)
    assert seen and all(not kwargs & {"seq_idx", "cu_seq_lens_q"} for kwargs in seen)


@pytest.mark.parametrize("family", THREADED)
def test_no_module_state_is_written_during_a_forward(family):
    """Eager and compiled, the patched forward leaves every module's attributes as they were."""
    torch.manual_seed(0)
    model = compilepack.patch(build_tiny(family).eval())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    state = lambda: {name: (set(m.__dict__), set(m._buffers), set(m._modules)) for name, m in model.named_modules()}  # noqa
    before = state()
    batch = hf_batch(random_docs(model.config.vocab_size, LENGTHS))
    with torch.no_grad():
        model(**batch)
        assert state() == before
        compiled(**batch)
        assert state() == before


@pytest.mark.parametrize("family", THREADED)
def test_gradient_checkpointing_recompute_sees_the_boundaries(family):
    """With gradient checkpointing the backward re-runs each layer's forward: the boundaries must reach it again
    (they do as arguments; state set during the first forward would be gone), so packed gradients still equal
    the sum over documents run alone."""
    torch.manual_seed(0)
    model = build_tiny(family)
    docs = random_docs(model.config.vocab_size, LENGTHS, seed=1)
    model.train()
    model.gradient_checkpointing_enable()
    batch = hf_batch(docs)
    for doc in docs:
        alone = hf_batch([doc])
        summed_token_loss(model(input_ids=alone["input_ids"], use_cache=False).logits, alone["labels"]).backward()
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compilepack.patch(model)
    summed_token_loss(model(**batch).logits, batch["labels"]).backward()
    packed = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert relative_grad_error(packed, alone_grads) <= 1e-4
