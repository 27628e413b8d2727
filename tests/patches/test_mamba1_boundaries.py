"""Why the Mamba1 families (Mamba, FalconMamba, Jamba) declare ``boundary_calls``.

In transformers 5.24 the Mamba1 stacks drop ``**kwargs`` on the way down (``MambaForCausalLM`` -> ``backbone``,
``MambaModel`` -> each block, ``MambaBlock`` / ``JambaMambaDecoderLayer`` -> the mixer), and every Mamba1 mixer
calls ``mamba_selective_scan`` (and ``mamba_inner_fn``) without its kwargs. This pins that fact: if a
transformers release starts passing them, the threading becomes redundant (and ``boundary_calls`` must then be
dropped, since a threaded call that also passes ``**kwargs`` would receive the keys twice).
"""

from __future__ import annotations

import pytest
import torch

from compilepack.patching import family_named
from tests.models import hf_batch, random_docs

MIXERS = {"mamba": "MambaMixer", "falcon_mamba": "FalconMambaMixer", "jamba": "JambaMambaMixer"}


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_transformers_drops_the_boundaries_before_the_mixer(name):
    family = family_named(name)
    torch.manual_seed(0)
    model = family.build_tiny().eval()
    seen = []
    for layer in model.modules():
        if type(layer).__name__ == MIXERS[name]:
            layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(**hf_batch(random_docs(model.config.vocab_size, [70, 1, 23, 5])), use_cache=False)
    assert seen and all(not kwargs & {"seq_idx", "cu_seq_lens_q"} for kwargs in seen)
