"""A few real inductor compiles (slow on CPU): training steps of a patched model equal eager, one compile."""

from __future__ import annotations

import pytest
import torch

from compilepack.patching import family_named
from tests.compiling import graphs_compiled
from tests.models import build_pair, hf_batch, random_docs

pytestmark = pytest.mark.inductor


def _gradients(step, model, batch):
    model.zero_grad()
    loss = step(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("family_name", ["llama", "qwen3_5"])
def test_inductor_training_steps_equal_eager_and_compile_once(family_name):
    _, patched = build_pair(family_named(family_name))
    patched.train()
    vocab = patched.config.get_text_config().vocab_size
    batches = [hf_batch(random_docs(vocab, lengths, seed=i))
               for i, lengths in enumerate([[70, 5, 1], [33, 90], [12, 2, 40, 8]])]
    compiled = torch.compile(patched, backend="inductor", fullgraph=True, dynamic=True)
    with graphs_compiled() as compiles:
        for batch in batches:
            loss, grads = _gradients(compiled, patched, batch)
            eager_loss, eager_grads = _gradients(patched, patched, batch)
            assert grads.keys() == eager_grads.keys()
            assert torch.allclose(loss, eager_loss, rtol=1e-5, atol=1e-6)
            scale = max(g.abs().max().item() for g in eager_grads.values())
            assert max((grads[n] - g).abs().max().item() for n, g in eager_grads.items()) <= 1e-4 * scale
        assert compiles() == 1
